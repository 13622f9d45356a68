"""Helpers shared by the tests and the benchmarks: free ports, managed subprocesses, a scriptable
OpenAI backend, the real gateway, redis-server, real vLLM engines, and the benchmarks' machinery
(workloads, the reference placement, replay, engine fleets, the routers under test, the report
writers and their checks).

A top-level package rather than `tests/support`: the benchmarks use these helpers too, and a
benchmark importing from the test tree (a pytest collection root, with its conftest) ties the two
together. It is not shipped in the wheel (pyproject.toml's `packages.find` lists router, cachelayer,
kvwire and kvgate_common only): it starts test backends, redis-server and vLLM environments, which a
user of the gateway never needs. Tests and benchmarks import it from the repository root (pytest's
rootdir, `python -m benchmarks.NAME`); the processes it starts get the same root on PYTHONPATH. A
helper two test modules use lives here, never in one of them: no test module imports another, and
none imports a benchmark (tests/test_import_directions.py): what a test checks of a benchmark (its
report) lives here, and the benchmark imports it.

Import what you use from its module (`kvgate_testing.ports`, `.gateway`, ...): this file imports
nothing, so a module with light dependencies (the numpy CacheGen baseline on a GPU machine) loads
without the rest. Every process started through these helpers is killed by its owner (a context
manager or a pytest fixture finalizer), even when the test fails.
"""
