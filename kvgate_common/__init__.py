"""kvgate_common: the ground floor the gateway (`router`), the cache layer (`cachelayer`) and the
wire protocol (`kvwire`) share, where each would otherwise keep its own copy.

It holds what is the same wording or the same layout on both sides of the router/cachelayer line
and belongs to neither; it imports none of the three (tests/test_import_directions.py), and needs
nothing beyond the standard library and PyYAML:
- `yaml_errors`: a configuration file's errors as one line each (`file:line:column: problem`,
  the bad value beside a validation error);
- `help_format`: the `--help` layout of both console scripts (`kvgate`, `cachelayer`).
"""
