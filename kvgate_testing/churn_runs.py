"""The routing benchmark's churn scenario: how much of what the router credits in a shared tier the
tier really holds, with the engines announcing the tier's removals (after issue 39) and without
(before), side by side in one run.

Per variant, a fresh fleet of simulated engines (`kvgate sim`) shares one tier in a real redis-server
under `maxmemory` with `allkeys-lru`, sized to hold about `capacity_share` of the workload's documents,
so it evicts all the time; halfway through the replay the server is killed and started again empty
on the same port (the shared store restarted, as a cache daemon that comes back). The variants
differ in one `kvgate sim` flag: `--shared-tier-removals` (the engines retract what the store
evicted and clear the shared medium when it restarted) or not. kv_aware told of the tier routes the
workload through a gateway process, as `routing_bench --shared-tier` does.

What is credited: the benchmark process subscribes the router's own index (`KVIndexService`, with
`SharedTiers` crediting the tier to every member, as kv_aware does) to the same engines' event
streams. Every `sample_every_s` it takes `sample_size` prompts of the workload, asks that index how
many of their leading tokens it credits in the shared tier, and asks Redis which of their blocks it
holds at that moment (EXISTS, which leaves the keys' LRU clocks alone): credited tokens past the
first block Redis lacks were not loadable. The figure is loadable credited tokens over credited
tokens, over every sample.
"""

from __future__ import annotations

import json
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate_testing.routers import SHARED_TIER_POLICY
from kvgate_testing.routing_runs import run_policy
from kvgate_testing.sim_fleet import EngineFleet
from kvgate_testing.workloads import Workload
from kvwire import tier_of
from router.config import KVEvents, SharedTier
from router.index.service import KVIndexService
from router.policies.shared_tiers import SharedTiers
from router.sim.blocks import chained_block_hashes
from router.sim.shared_store import MEDIUM_SHARED, block_key

# Each block's value in the store (the sims' --shared-block-bytes): large enough that the server's
# pub/sub output buffers (every eviction is a message to every watching member) stay small beside
# the data that `maxmemory` is meant to bound.
BLOCK_BYTES = 2048
REDIS_ARGS = ["--maxmemory-policy", "allkeys-lru", "--notify-keyspace-events", "Exeg"]


@dataclass(frozen=True)
class ChurnVariant:
    name: str
    removals: bool  # the engines run with --shared-tier-removals


VARIANTS = (
    ChurnVariant("before: removals not announced", False),
    ChurnVariant("after: removals and restart announced", True),
)


@dataclass(frozen=True)
class ChurnSettings:
    engines: int
    num_gpu_blocks: int
    block_size: int
    sim_args: list[str]
    tier: str
    concurrency: int
    capacity_share: float = 1 / 3  # of the documents' blocks the store holds
    sample_every_s: float = 0.25
    sample_size: int = 40
    seed: int = 11


def document_blocks(workload: Workload, block_size: int) -> int:
    """Distinct full blocks over the workload's prompts that more than one request reads."""
    seen: dict[int, int] = {}
    for request in workload.requests:
        for block in chained_block_hashes(request.prompt_token_ids, block_size, None):
            seen[block] = seen.get(block, 0) + 1
    return sum(1 for count in seen.values() if count > 1)


def _bytes_per_block(fleet: EngineFleet, tier: str) -> float:
    """What one block of the sims' shape takes in this server (key, value, bookkeeping), measured."""
    probes = 2000
    with fleet.shared_store.client() as client:
        before = int(client.info("memory")["used_memory"])
        keys = [block_key(tier, (1 << 63) + index) for index in range(probes)]
        client.mset({key: b"k" * BLOCK_BYTES for key in keys})
        grown = int(client.info("memory")["used_memory"]) - before
        client.delete(*keys)
    return grown / probes


class CreditSampler:
    """Samples, while the replay runs, what the router's index credits in the shared tier against
    what Redis holds (the module docstring says how)."""

    def __init__(self, fleet: EngineFleet, workload: Workload, settings: ChurnSettings) -> None:
        self.fleet = fleet
        self.settings = settings
        self.names = [engine.name for engine in fleet.engines]
        self.service = KVIndexService(replay_timeout_s=1.0)
        tiers = [SharedTier(name=MEDIUM_SHARED, backends=self.names)]
        self.service.share_removals(tiers)  # as the gateway's wiring does
        for engine in fleet.engines:
            self.service.add_backend(
                engine.name,
                KVEvents(endpoint=engine.events_endpoint, replay_endpoint=engine.replay_endpoint),
            )
        self.shared = SharedTiers(tiers)
        self.tier_name = tier_of(MEDIUM_SHARED)
        self.prompts = [request.prompt_token_ids for request in workload.requests]
        self.samples: list[dict[str, float]] = []
        self.credited = self.loadable = self.held = 0
        self.first_credit = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="credit-sampler", daemon=True)
        self._started = 0.0

    def start(self) -> None:
        self.service.start()
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.service.stop()

    def _run(self) -> None:
        rng = random.Random(self.settings.seed)
        server = self.fleet.shared_store
        client = server.client()
        while not self._stop.wait(self.settings.sample_every_s):
            try:
                credited, loadable, held = self._sample(rng, client)
            except Exception:  # the server is being restarted: no sample this time
                client.close()
                client = server.client()
                continue
            self.credited += credited
            self.loadable += loadable
            self.held += held
            if credited:
                self.first_credit.set()
            self.samples.append(
                {
                    "t_s": round(time.monotonic() - self._started, 2),
                    "credited": credited,
                    "loadable": loadable,
                    "held": held,
                    "fraction": loadable / credited if credited else None,
                }
            )
        client.close()

    def _sample(self, rng: random.Random, client: Any) -> tuple[int, int, int]:
        """(credited, credited and loadable, held) tokens over one sample of prompts; held: the
        leading tokens Redis holds, credited or not (what a router could have credited)."""
        credited_sample = loadable_sample = held_sample = 0
        size = self.settings.block_size
        for prompt in rng.sample(self.prompts, self.settings.sample_size):
            matches = self.shared.credit(self.service.longest_cached_prefix(prompt, backends=self.names))
            credited = max((match.by_tier.get(self.tier_name, 0) for match in matches.values()), default=0)
            hashes = chained_block_hashes(prompt, size, None)
            with client.pipeline(transaction=False) as pipe:
                for block in hashes:
                    pipe.exists(block_key(self.settings.tier, block))
                present = pipe.execute()
            held = next((i for i, is_held in enumerate(present) if not is_held), len(present)) * size
            held_sample += held
            credited_sample += credited
            loadable_sample += min(credited, held)
        return credited_sample, loadable_sample, held_sample


def run_variant(variant: ChurnVariant, workload: Workload, settings: ChurnSettings, log: Any) -> dict:
    sim_args = [*settings.sim_args, "--shared-block-bytes", str(BLOCK_BYTES)]
    if variant.removals:
        sim_args.append("--shared-tier-removals")
    fleet = EngineFleet(
        settings.engines, settings.num_gpu_blocks, settings.block_size, sim_args, settings.tier,
        redis_args=REDIS_ARGS,
    )  # fmt: skip
    duration_s = max(request.arrival_s for request in workload.requests)
    with fleet:
        per_block = _bytes_per_block(fleet, settings.tier)
        blocks = document_blocks(workload, settings.block_size)
        with fleet.shared_store.client() as client:
            baseline = int(client.info("memory")["used_memory"])
        maxmemory = int(baseline + per_block * blocks * settings.capacity_share)
        # Given at start, so the restarted server gets it too.
        fleet.shared_store.extra_args += ["--maxmemory", str(maxmemory)]
        with fleet.shared_store.client() as client:
            client.config_set("maxmemory", maxmemory)
        sampler = CreditSampler(fleet, workload, settings)
        sampler.start()
        restarted_at: list[float] = []

        def restart_halfway() -> None:
            if not sampler.first_credit.wait(timeout=120):
                return
            time.sleep(duration_s / 2)
            restarted_at.append(round(time.monotonic() - sampler._started, 2))
            log(f"  restarting the shared store ({variant.name})")
            fleet.restart_shared_store()

        restarter = threading.Thread(target=restart_halfway, name="store-restart", daemon=True)
        restarter.start()
        try:
            measured = run_policy(fleet, SHARED_TIER_POLICY, workload, settings.concurrency)
        finally:
            restarter.join(timeout=duration_s + 130)
            sampler.stop()
        with fleet.shared_store.client() as client:
            evicted = int(client.info("stats")["evicted_keys"])  # since the restart
    return {
        "variant": variant.name,
        "shared_tier_removals": variant.removals,
        "credited_tokens": sampler.credited,
        "loadable_credited_tokens": sampler.loadable,
        "credited_loadable_fraction": round(sampler.loadable / sampler.credited, 4)
        if sampler.credited
        else None,
        # Of what Redis held as leading blocks of the sampled prompts, the share the router credited.
        "held_tokens": sampler.held,
        "held_credited_fraction": round(sampler.loadable / sampler.held, 4) if sampler.held else None,
        "samples": sampler.samples,
        "store_restarted_at_s": restarted_at[0] if restarted_at else None,
        "maxmemory_bytes": maxmemory,
        "store_capacity_blocks": int(blocks * settings.capacity_share),
        "document_blocks": blocks,
        "bytes_per_block": round(per_block, 1),
        "evicted_keys_after_restart": evicted,
        "hit_ratio": measured.get("hit_ratio"),
        "errors": measured.get("errors"),
        "ttft_p50": measured.get("ttft_p50"),
        "router_cpu_ms_per_request": measured.get("router_cpu_ms_per_request"),
    }


def run_churn(workload: Workload, settings: ChurnSettings, log: Any) -> dict:
    """Both variants on the same seeded workload, one after the other; their results by name."""
    runs = []
    for variant in VARIANTS:
        log(f"churn: {variant.name}")
        run = run_variant(variant, workload, settings, log)
        log(f"  credited loadable {run['credited_loadable_fraction']}  hit {run['hit_ratio']}")
        runs.append(run)
    before, after = runs
    return {
        "credited_loadable_fraction_before": before["credited_loadable_fraction"],
        "credited_loadable_fraction_after": after["credited_loadable_fraction"],
        "runs": runs,
    }


def write_results(results: dict, output: Path) -> None:
    """<output>.json (everything), .md (the side-by-side table) and .png (the samples over time)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    output.with_suffix(".md").write_text("\n".join(markdown_lines(results)) + "\n")
    write_plot(results, output.with_suffix(".png"))


def markdown_lines(results: dict) -> list[str]:
    source, meta = results.get("source", {}), results["meta"]
    settings = meta["settings"]
    first = results["runs"][0]
    lines = [
        "## Churn: credited shared-tier tokens that were loadable",
        "",
        f"Commit {source.get('commit')} (dirty: {source.get('dirty')}), {meta['date']}, {meta['machine']}, "
        f"load average {meta['load_average_start']} at start, {meta['load_average_end']} at end. "
        f"`{meta['command']}`.",
        "",
        f"{settings['engines']} simulated engines ({settings['num_gpu_blocks']} GPU blocks each) share one "
        f"tier in a redis-server under maxmemory with allkeys-lru, holding about "
        f"{first['store_capacity_blocks']} of the workload's {first['document_blocks']} reused blocks; "
        "the server is killed and restarted empty halfway through each replay. Workload "
        f"`{meta['workload']}` ({meta['workload_description']}) through kv_aware told of the tier. "
        "Same seeded workload and samples per variant; the variants differ only in "
        "`kvgate sim --shared-tier-removals`.",
        "",
        "| variant | credited tokens loadable | credited tokens sampled | samples | store restarted at (s) "
        "| evictions after restart | hit ratio | TTFT p50 ms | errors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in results["runs"]:
        lines.append(
            f"| {run['variant']} | {run['credited_loadable_fraction']} | {run['credited_tokens']} "
            f"| {len(run['samples'])} | {run['store_restarted_at_s']} | {run['evicted_keys_after_restart']} "
            f"| {run['hit_ratio']} | {run['ttft_p50']} | {run['errors']} |"
        )
    lines += [
        "",
        "`credited tokens loadable`: over every sample, the shared-tier tokens the router's index "
        "credited (kv_aware's SharedTiers rule) that Redis held as a leading run of blocks at that "
        "moment, over all it credited.",
    ]
    return lines


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5))
    for run in results["runs"]:
        axis.plot(
            [s["t_s"] for s in run["samples"]], [s["fraction"] for s in run["samples"]], label=run["variant"]
        )
        if run["store_restarted_at_s"] is not None:
            axis.axvline(run["store_restarted_at_s"], linestyle=":", color="grey")
    axis.set_xlabel("seconds into the variant (dotted: the store restarted)")
    axis.set_ylabel("credited shared-tier tokens that were loadable")
    axis.set_ylim(0, 1.05)
    axis.legend(loc="lower left", fontsize=8)
    axis.set_title("Router's credit vs the shared tier under allkeys-lru churn and a restart")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
