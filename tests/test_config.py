"""proxy.yaml validation: a bad configuration is refused with the file, the key path and what was expected."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from router.config import ConfigError, load_config, parse_config

VALID = {
    "listen": {"host": "127.0.0.1", "port": 8080},
    "models": [{"name": "tiny-qwen3"}],
    "backends": [
        {
            "name": "engine-a",
            "url": "http://127.0.0.1:8001",
            "kv_events": {
                "endpoint": "tcp://127.0.0.1:5557",
                "replay_endpoint": "tcp://127.0.0.1:5558",
                "topic": "kv-events",
            },
        }
    ],
    "policy": {"name": "round_robin"},
}


def with_changes(**changes) -> dict:
    config = yaml.safe_load(yaml.safe_dump(VALID))
    config.update(changes)
    return config


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_issue_example_loads(tmp_path):
    config = load_config(write(tmp_path, VALID))
    assert config.backends[0].name == "engine-a"
    assert config.backends[0].kv_events.replay_endpoint == "tcp://127.0.0.1:5558"
    assert config.policy.__struct_config__.tag == "round_robin"
    assert config.limits.max_body_bytes == 32 * 1024 * 1024
    assert config.limits.max_header_bytes == 64 * 1024
    assert config.limits.max_client_connections is None  # derived from RLIMIT_NOFILE at start


@pytest.mark.parametrize(
    ("data", "where", "expected"),
    [
        (with_changes(unknown_key=1), "(top level)", "unknown field `unknown_key`"),
        (
            with_changes(backends=[{"name": "a", "url": "http://h:1", "weight": 2}]),
            "backends[0]",
            "unknown field `weight`",
        ),
        (with_changes(listen={"host": "127.0.0.1", "port": "eighty"}), "listen.port", "Expected `int`"),
        (with_changes(limits={"max_body_bytes": -5}), "limits.max_body_bytes", ">= 1"),
        (with_changes(limits={"max_header_bytes": 100}), "limits.max_header_bytes", ">= 1024"),
        (with_changes(limits={"header_timeout_s": 0}), "limits.header_timeout_s", "> 0"),
        (with_changes(limits={"max_client_connections": 0}), "limits.max_client_connections", ">= 1"),
        (
            with_changes(backends=[{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]),
            "backends[1].name",
            "duplicate backend name 'a'",
        ),
        (
            with_changes(backends=[{"name": "a", "url": "ftp://h:1"}]),
            "backends[0]",
            "must look like http://host:port",
        ),
        (with_changes(backends=[{"name": "a", "url": "http://h:99999"}]), "backends[0]", "bad port"),
        (
            with_changes(policy={"name": "fastest"}),
            "policy.name",
            "known policies: round_robin, least_loaded",
        ),
        (with_changes(models=[]), "models", "length >= 1"),
        (with_changes(backends=[]), "backends", "no backends"),
        (
            with_changes(backends=[{"name": "a", "url": "http://h:1", "models": ["other"]}]),
            "backends[0].models",
            "unknown model 'other'",
        ),
    ],
)
def test_bad_configuration_names_file_key_and_expectation(tmp_path, data, where, expected):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: invalid configuration at `{where}`"), message
    assert expected in message


def test_not_yaml_and_missing_file_are_clear(tmp_path):
    path = tmp_path / "proxy.yaml"
    path.write_text("models: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read configuration"):
        load_config(tmp_path / "missing.yaml")
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "models:\n  - name: x\n    tokenizer: [unclosed\nbackends: []\n",
            ":4:9: not valid YAML: expected ',' or ']', but got ':' "
            "(while parsing a flow sequence at line 3)",
        ),
        ("listen:\n  host: 127.0.0.1\n port: 8080\n", ":3:2: not valid YAML: "),
        ('models: "unterminated\n', ":2:1: not valid YAML: found unexpected end of stream"),
    ],
)
def test_a_yaml_syntax_error_is_one_line_with_file_line_and_column(tmp_path, text, expected):
    path = tmp_path / "proxy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}{expected}"), message
    assert "\n" not in message and "<unicode string>" not in message


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"listen": {"host": "127.0.0.1", "port": "eighty"}},
            "Expected `int`, got `str` (the value given: 'eighty')",
        ),
        ({"limits": {"max_body_bytes": -5}}, ">= 1 (the value given: -5)"),
        ({"backends": [{"name": "a", "url": 8000}]}, "Expected `str`, got `int` (the value given: 8000)"),
    ],
)
def test_a_wrong_value_is_shown_beside_what_was_expected(tmp_path, changes, expected):
    path = write(tmp_path, with_changes(**changes))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).endswith(expected), str(caught.value)


def test_parse_config_accepts_defaults():
    config = parse_config({"models": [{"name": "m"}], "backends": [{"name": "a", "url": "http://h:1/"}]})
    assert config.backends[0].url == "http://h:1"  # trailing slash dropped
    assert config.listen.port == 8080


def test_kvgate_serve_refuses_a_bad_configuration(tmp_path):
    path = write(tmp_path, with_changes(policy={"name": "fastest"}))
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"{path}: invalid configuration at `policy.name`" in result.stderr
    assert "Traceback" not in result.stderr


def test_shared_tiers_name_the_backends_that_read_one_store():
    two_backends = VALID["backends"] + [{"name": "engine-b", "url": "http://127.0.0.1:8002"}]
    config = parse_config(
        with_changes(
            backends=two_backends,
            shared_tiers=[{"name": "remote", "backends": ["engine-a", "engine-b"], "hit_weight": 0.7}],
        )
    )
    assert [(t.name, t.backends, t.hit_weight) for t in config.shared_tiers] == [
        ("remote", ["engine-a", "engine-b"], 0.7)
    ]


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [
        (
            [{"name": "remote", "backends": ["engine-z"]}],
            "shared_tiers[0].backends`: unknown backend 'engine-z'",
        ),
        (
            [{"name": "GPU", "backends": ["engine-a"]}],
            "shared_tiers[0].name`: 'GPU' is an engine's own GPU tier",
        ),
        (
            [{"name": "remote", "backends": ["engine-a"]}, {"name": "Remote", "backends": ["engine-a"]}],
            "backend 'engine-a' is attached to tier 'Remote' in shared_tiers[0] already",
        ),
        (
            [{"name": "remote", "backends": ["engine-a"]}, {"name": "remote", "backends": []}],
            "shared_tiers[1].backends`: Expected `array` of length >= 1",
        ),
    ],
)
def test_bad_shared_tiers_are_refused_with_the_key(tiers, expected):
    with pytest.raises(ConfigError) as error:
        parse_config(with_changes(shared_tiers=tiers), "proxy.yaml")
    assert expected in str(error.value)
