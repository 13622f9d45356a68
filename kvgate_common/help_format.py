"""The `--help` layout of kvgate's console scripts (`kvgate`: router/cli.py, `cachelayer`:
cachelayer/cli.py): one formatter, so that both show their flags' defaults the same way."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none to show (None, off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)
