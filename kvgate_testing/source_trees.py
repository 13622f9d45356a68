"""Gateways run from source trees, for before/after comparisons in one run (`--gateway LABEL=DIR`):
the tree before a change as a git worktree beside this checkout, each gateway importing its own tree."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from kvgate_testing.ports import free_port
from kvgate_testing.processes import ManagedProcess, wait_for_http
from kvgate_testing.routers import kvgate_backends, wait_until_synced
from kvgate_testing.sim_fleet import MODEL, EngineFleet


def parse_gateway_trees(items: list[str], default: tuple[str, Path]) -> list[tuple[str, Path]]:
    """`--gateway LABEL=DIR` values as (label, resolved tree); `default` when there are none.
    Raises ValueError naming the value that is not LABEL=DIR with DIR a source tree holding router/."""
    trees = []
    for item in items:
        label, separator, directory = item.partition("=")
        if not separator or not label or not Path(directory, "router").is_dir():
            raise ValueError(f"--gateway {item!r} must be LABEL=DIR, DIR a source tree with router/")
        trees.append((label, Path(directory).resolve()))
    return trees or [default]


def start_tree_gateway(
    tree: Path, fleet: EngineFleet, config_prefix: str, policy: str = "kv_aware"
) -> tuple[ManagedProcess, str]:
    """The gateway of `tree` (its router/ on PYTHONPATH, run from it) in front of `fleet` with
    `policy` and the builtin Qwen3 tokenizer; returns (process, URL) once it answers /health and every
    KV-event subscriber is synced. The caller stops the process."""
    port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "models": [{"name": MODEL, "tokenizer": "builtin:qwen3"}],
        "backends": kvgate_backends(fleet, policy),
        "policy": {"name": policy},
        "log_level": "warning",
    }
    handle, path = tempfile.mkstemp(prefix=config_prefix, suffix=".yaml")
    with os.fdopen(handle, "w") as file:
        yaml.safe_dump(config, file)
    process = ManagedProcess(
        [sys.executable, "-m", "router.cli", "serve", "--config", path],
        env={"PYTHONPATH": str(tree)},
        cwd=str(tree),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/health", process, 90)
        wait_until_synced(url, 60)
    except BaseException:
        process.stop()
        raise
    return process, url


def tree_revision(tree: Path) -> str:
    """`tree`'s commit (short hash), "+ uncommitted changes" when tracked files differ; "" outside git."""
    try:

        def git(*args: str) -> str:
            command = ["git", "-C", str(tree), *args]
            return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()

        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return ""
