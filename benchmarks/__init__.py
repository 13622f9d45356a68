"""kvgate's benchmarks: each module is a command, run from the repository root as
`python -m benchmarks.NAME` (docs/benchmarks.md lists them). What the benchmarks share with the tests
(workloads, the reference placement, replay, the engine fleets, the routers under test, the reports'
checks) lives in `kvgate_testing`; nothing under tests/ imports a benchmark."""
