"""docs/configuration.md documents every key of proxy.yaml (router/config.py) and of the cache
layer's configuration (cachelayer/config.py), each with its default, in the section of its path.

The structs are walked recursively with msgspec.inspect, so a key added to a struct and not to the
reference fails here, named with its path and its struct.
"""

from __future__ import annotations

import re

import msgspec
import msgspec.inspect as inspect
import yaml

from cachelayer.config import CacheLayerConfig
from kvgate_testing.processes import REPO_ROOT
from router.config import Config

REFERENCE = REPO_ROOT / "docs" / "configuration.md"


class DocumentedKey(msgspec.Struct):
    default: str  # the default column as written (backticks removed)


def _sections() -> dict[str, dict[str, DocumentedKey]]:
    """Heading (backticks removed) -> {key: its row} for every `| `key` | default | meaning |` row."""
    sections: dict[str, dict[str, DocumentedKey]] = {}
    current: dict[str, DocumentedKey] | None = None
    for line in REFERENCE.read_text().splitlines():
        heading = re.match(r"#{2,4} (.+)", line)
        if heading:
            current = sections.setdefault(heading.group(1).replace("`", "").strip(), {})
            continue
        row = re.match(r"\|\s*`([A-Za-z0-9_]+)`\s*\|([^|]*)\|", line)
        if row and current is not None:
            current[row.group(1)] = DocumentedKey(row.group(2).replace("`", "").strip())
    return sections


def _structs(type_info: inspect.Type, path: str) -> list[tuple[str, inspect.StructType]]:
    """Every struct reachable from `type_info`, with the heading that documents it."""
    if isinstance(type_info, inspect.StructType):
        if type_info.tag is not None:
            path = f"{path}: {type_info.tag}"  # a policy: one section per `name`
        found = [(path, type_info)]
        for field in type_info.fields:
            found += _structs(field.type, field.name if path in _ROOTS else f"{path}.{field.name}")
        return found
    if isinstance(type_info, inspect.ListType):
        return _structs(type_info.item_type, f"{path}[]")
    if isinstance(type_info, inspect.UnionType):
        return [found for member in type_info.types for found in _structs(member, path)]
    return []


_ROOTS = ("proxy.yaml", "cache layer configuration")


def _default(field: inspect.Field) -> object:
    if field.default is not inspect.NODEFAULT:
        return field.default
    if field.default_factory is not inspect.NODEFAULT:
        return field.default_factory()
    return "required"


def _is_section(field_type: inspect.Type) -> bool:
    members = field_type.types if isinstance(field_type, inspect.UnionType) else (field_type,)
    items = [m.item_type if isinstance(m, inspect.ListType) else m for m in members]
    return any(isinstance(item, inspect.StructType) for item in items)


def test_every_configuration_key_is_documented_with_its_default():
    sections = _sections()
    structs = _structs(inspect.type_info(Config), "proxy.yaml") + _structs(
        inspect.type_info(CacheLayerConfig), "cache layer configuration"
    )
    missing_sections, missing_keys, wrong_defaults = [], [], []
    for path, struct in structs:
        where = f"{struct.cls.__module__}.{struct.cls.__name__}"
        if path not in sections:
            missing_sections.append(f"### {path}  ({where})")
            continue
        for field in struct.fields:
            documented = sections[path].get(field.name)
            if documented is None:
                missing_keys.append(f"{path} -> {field.name}  ({where})")
                continue
            if _is_section(field.type):
                continue  # documented in its own section
            expected = _default(field)
            written = documented.default
            if expected == "required":
                ok = written == "required"
            else:
                try:
                    ok = yaml.safe_load(written) == expected
                except yaml.YAMLError:
                    ok = False
            if not ok:
                wrong_defaults.append(f"{path} -> {field.name}: doc says {written!r}, code {expected!r}")
    problems = []
    if missing_sections:
        problems.append(
            "sections missing (add a heading and a key table):\n  " + "\n  ".join(missing_sections)
        )
    if missing_keys:
        problems.append(
            "keys missing (add a `| `key` | default | meaning |` row):\n  " + "\n  ".join(missing_keys)
        )
    if wrong_defaults:
        problems.append("defaults that differ from the code:\n  " + "\n  ".join(wrong_defaults))
    assert not problems, f"{REFERENCE.relative_to(REPO_ROOT)} is out of date:\n" + "\n".join(problems)


def test_the_reference_documents_no_key_the_code_does_not_have():
    sections = _sections()
    known = {
        path: {field.name for field in struct.fields}
        for path, struct in _structs(inspect.type_info(Config), "proxy.yaml")
        + _structs(inspect.type_info(CacheLayerConfig), "cache layer configuration")
    }
    stale = [
        f"{path} -> {key}"
        for path, keys in sections.items()
        if path in known
        for key in keys
        if key not in known[path]
    ]
    assert not stale, "docs/configuration.md documents keys the code no longer has:\n  " + "\n  ".join(stale)
