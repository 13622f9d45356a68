"""kvgate_common.help_format: both console scripts' --help shows a flag's default only where there
is one to show (tests/test_gateway_api_surface.py runs the scripts themselves)."""

from __future__ import annotations

import argparse

from kvgate_common.help_format import DefaultsHelpFormatter


def test_help_shows_real_defaults_and_hides_none_off_and_empty() -> None:
    parser = argparse.ArgumentParser(prog="example", formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--port", type=int, default=5555, help="the port")
    parser.add_argument("--config", default=None, help="the file")
    parser.add_argument("--verbose", action="store_true", help="say more")
    parser.add_argument("--backend", action="append", default=[], help="a backend")
    text = " ".join(parser.format_help().split())
    assert "the port (default: 5555)" in text
    assert "the file" in text and "(default: None)" not in text
    assert "say more" in text and "(default: False)" not in text
    assert "a backend" in text and "(default: [])" not in text
