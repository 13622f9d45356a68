"""`python -m kvgate_testing.gateway_with_extensions MODULE:FUNCTION[,...] serve --config proxy.yaml`:
the real `kvgate` command line, with test-only extension factories appended to the gateway's own
(router/extensions.py EXTENSION_FACTORIES). start_gateway(config, extensions=[...]) runs it."""

from __future__ import annotations

import sys

from router import cli, extensions


def main(argv: list[str]) -> int:
    extensions.EXTENSION_FACTORIES.extend(argv[0].split(","))
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
