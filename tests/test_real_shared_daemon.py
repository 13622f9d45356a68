"""Two real vLLM instances sharing one cache daemon (`cachelayer server`).

Instance B has never seen the prompt: its hit can only come from the chunks instance A stored in
the daemon. A salted request must not see them (0 chunks read), and the greedy outputs of the
cold, hit and salted requests must be identical: the cache layer changes speed, never results.
Both engines run on the daemon's host, so their KV moves through its shared memory (leases), and
their saves finish in the background: the daemon's counters are read once the writes landed.
The daemon has a secret, which the engines' connectors present (`server_auth_secret_env`).
"""

from __future__ import annotations

import pytest

from kvgate_testing.vllm import (
    DAEMON_TEST_SECRET,
    cached_tokens,
    greedy_output,
    prompt_tokens,
    running_cache_daemon,
    running_vllms,
    wait_until,
    write_cache_config,
)

pytestmark = pytest.mark.real_engine

CHUNK = 256
READS = "lmcache_mp_l1_read_chunks_total"
WRITES = "lmcache_mp_l1_write_chunks_total"
LEASES = "cachelayer_daemon_leases_total"
SECRET_ENV = "KVGATE_DAEMON_SECRET"


def metrics_once_written(daemon, writes: int) -> dict[str, float]:
    """The daemon's metrics once `writes` chunks were written (saves finish after the response)."""
    wait_until(lambda: daemon.metrics()[WRITES] >= writes, timeout_s=30)
    return daemon.metrics()


def test_instance_b_hits_what_instance_a_stored_in_the_daemon(tmp_path):
    config = write_cache_config(tmp_path, chunk_size=CHUNK, server_auth_secret_env=SECRET_ENV)
    prompt = prompt_tokens(700, seed=2)
    with running_cache_daemon(chunk_size=CHUNK, secret_env=SECRET_ENV) as daemon:
        shared = {
            "cache_config": config,
            "cache_server": daemon.endpoint,
            "kv_events": False,
            "extra_env": {SECRET_ENV: DAEMON_TEST_SECRET},
        }
        with running_vllms({"name": "vllm-a", **shared}, {"name": "vllm-b", **shared}) as (
            engine_a,
            engine_b,
        ):
            cold = engine_a.complete(prompt, max_tokens=12)
            after_store = metrics_once_written(daemon, 2)
            hit = engine_b.complete(prompt, max_tokens=12)
            after_hit = daemon.metrics()
            salted_cold = engine_b.complete(prompt, max_tokens=12, cache_salt="tenant-1")
            after_salted_cold = metrics_once_written(daemon, 4)
            salted_hit = engine_a.complete(prompt, max_tokens=12, cache_salt="tenant-1")
            after_salted_hit = daemon.metrics()

    assert cached_tokens(cold) == 0
    assert after_store[WRITES] == 2  # the 2 whole chunks of the 700-token prompt

    # B loaded A's two chunks from the daemon, through its shared memory (a read lease).
    assert cached_tokens(hit) == 2 * CHUNK
    assert after_hit[READS] - after_store[READS] == 2
    assert after_store[LEASES] >= 1 and after_hit[LEASES] > after_store[LEASES]
    assert after_salted_hit["cachelayer_daemon_open_leases"] == 0

    # The salted request reads nothing (its keys differ), computes everything, and stores its own.
    assert cached_tokens(salted_cold) == 0
    assert after_salted_cold[READS] - after_hit[READS] == 0
    assert after_salted_cold[WRITES] - after_hit[WRITES] == 2

    # Same salt on the other instance: a hit on the salted chunks.
    assert cached_tokens(salted_hit) == 2 * CHUNK
    assert after_salted_hit[READS] - after_salted_cold[READS] == 2

    reference_tokens, reference_logprobs = greedy_output(cold)
    for response in (hit, salted_cold, salted_hit):
        tokens, logprobs = greedy_output(response)
        assert tokens == reference_tokens
        assert logprobs == pytest.approx(reference_logprobs, abs=1e-3)
    assert after_salted_hit["lmcache_mp_lookup_hit_tokens_total"] > 0
    assert 0 < after_salted_hit["lmcache_mp_l1_usage_ratio"] < 1
