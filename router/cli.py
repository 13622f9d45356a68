"""The `kvgate` command line: one table of subcommands, each imported only when it is the one run.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and keeps its top-level
imports light: `kvgate serve` must not pay for what `kvgate sim` imports.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from typing import NamedTuple

from kvgate_common.help_format import DefaultsHelpFormatter


class Subcommand(NamedTuple):
    module: str
    help: str


# Add a subcommand with one line here (and its module).
SUBCOMMANDS: dict[str, Subcommand] = {
    "serve": Subcommand("router.serve", "run the gateway on a proxy.yaml"),
    "epp": Subcommand(
        "router.epp.cli", "run the endpoint picker (Envoy ext_proc, Gateway API Inference Extension)"
    ),
    "sim": Subcommand("router.sim.cli", "run one simulated vLLM-compatible engine (no GPU, no model)"),
    "demo": Subcommand("router.demo", "compare routing policies on simulated engines (about a minute)"),
}


def version() -> str:
    """The installed kvgate's version (a checkout run without installing says so)."""
    try:
        return importlib.metadata.version("kvgate")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser(chosen: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KV-cache-aware gateway for LLM inference engines",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvgate {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, subcommand in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(
            name,
            help=subcommand.help,
            description=subcommand.help,
            # --help shows each flag's default.
            formatter_class=DefaultsHelpFormatter,
        )
        if name == chosen:
            importlib.import_module(subcommand.module).add_arguments(subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # kvgate uses transformers for its tokenizers only, so its advice that PyTorch is missing (a
    # gateway-only install has none) is noise; the simulated engines inherit the setting.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(chosen if chosen in SUBCOMMANDS else None).parse_args(argv)
    return importlib.import_module(SUBCOMMANDS[args.command].module).run(args)


if __name__ == "__main__":
    sys.exit(main())
