"""A short run of the daemon fuzzer (kvgate_testing/fuzz_daemon.py; `make fuzz` runs it for minutes):
mutated frames against a live `cachelayer server` with a secret, which must answer every
authenticated message, none of the others, keep a good client's KV bit-exact and log no traceback."""

from __future__ import annotations

from kvgate_testing.fuzz_daemon import fuzz


def test_a_few_seconds_of_mutated_frames_leave_the_daemon_serving_and_its_log_clean():
    counts = fuzz(seconds=2.0, seed=3)
    assert counts["answered"] > 50 and counts["good_checks"] >= 1
    assert counts["answered"] + counts["unauthenticated"] == counts["messages"]
