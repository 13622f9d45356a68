"""kv_aware's request path, side by side: latency the gateway adds per request, its CPU per request,
and where the time goes, for the first request of a session and the later ones (chat turns, or
questions on a document).

Gateways under test are source trees (`--gateway LABEL=DIR`, repeatable; default: this tree), for
example the tree before a change as a git worktree:

    git worktree add -f /tmp/kvgate-before <rev> --detach
    ln -s $PWD/.venv $PWD/.cache /tmp/kvgate-before/
    .venv/bin/python -m benchmarks.kv_aware_latency --gateway before=/tmp/kvgate-before --gateway after=.

In one run:
- simulated engines (`kvgate sim`, real chat template and KV events) that answer at once (no
  prefill or decode time), so what a request costs beyond the engine is the gateway's;
- every gateway runs the kv_aware policy with the real Qwen3 tokenizer and subscribes to every
  engine's KV events (they all see the same events);
- a chat_sessions or document_qa workload (kvgate_testing/workloads.py), first sent untimed straight
  to every engine (each engine's tokenizer cache then answers every timed send alike, and the KV
  events are all in the gateways' indexes before the measured phase: each prompt is cached on
  every engine), then one request at a time to every gateway and straight to an engine, in
  rotating order; added latency = the gateway's time to the whole (non-streamed, one-token)
  answer minus the direct one, per request;
- CPU per request: utime+stime of each gateway process over the measured requests (/proc): no
  new KV events arrive then, so it is the request path's; and the gateway's own
  kvgate_gateway_overhead_seconds (request in -> sent upstream, plus answer headers in -> out),
  mean over the run;
- stages: each tree's request-path steps timed in a child process with that tree's code (body
  parse, chat template, encode, router keys, index lookup, policy), on the same prompts, with
  an index holding each routed prompt on its backend.

    .venv/bin/python -m benchmarks.kv_aware_latency [--workload document_qa] [--engines 8 --users 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvgate_testing.provenance import with_source

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
MODEL = "tiny-qwen3"
KINDS = ("first_turn", "follow_up")
OVERHEAD_METRIC = "kvgate_gateway_overhead_seconds"
# Engines that answer at once: the gateway's share of a request is all that differs between targets.
INSTANT_ENGINE = [
    "--prefill-us-per-token", "0", "--prefill-overhead-ms", "0",
    "--decode-ms-per-token", "0", "--decode-batch-slope", "0",
]  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _request_body(request) -> bytes:  # a kvgate_testing.workloads.WorkloadRequest
    return json.dumps(
        {
            "model": MODEL,
            "messages": request.messages,
            "max_tokens": 1,
            "temperature": 0.0,
            "user": request.session_id,
        }
    ).encode()


def build_workload(name: str, users: int, turns: int, seed: int) -> list:
    """The workload's requests in arrival order: `users` sessions (chats, or documents) of `turns`
    requests (chat turns, or questions on the document)."""
    from kvgate_testing.workloads import ChatSessionsParams, DocumentQAParams, chat_sessions, document_qa

    if name == "chat_sessions":
        workload = chat_sessions(ChatSessionsParams(users=users, turns=turns, seed=seed))
    else:
        workload = document_qa(DocumentQAParams(documents=users, questions_per_document=turns, seed=seed))
    return sorted(workload.requests, key=lambda r: r.arrival_s)


def request_kinds(requests: list) -> list[str]:
    """first_turn for a session's first request (a chat's first turn, a document's first question),
    follow_up for the later ones (the prompt's beginning was seen before)."""
    seen: set[str] = set()
    kinds = []
    for request in requests:
        kinds.append("follow_up" if request.session_id in seen else "first_turn")
        seen.add(request.session_id)
    return kinds


# ---------------------------------------------------------------- stages (child process, one tree)


class RequestPathSteps:
    """kv_aware's request-path steps in this process, one request at a time, each timed: body parse,
    chat template (render), encode, router keys, index lookup over `engines` engines, policy
    (choose and on_routed), with the real Qwen3 tokenizer and an index the caller fills."""

    STEPS = ("parse", "render", "encode", "keys", "lookup", "policy")

    def __init__(self, engines: int, model: str = MODEL) -> None:
        import msgspec

        from router.backends import BackendState
        from router.config import KVAwarePolicy, builtin_tokenizer_dir
        from router.index.service import KVIndexService
        from router.policies.kv_aware import KVAware
        from router.tokenize import PromptTokenizer

        self.model = model
        self.tokenizer = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
        self.service = KVIndexService()
        self.names = [f"engine-{i}" for i in range(engines)]
        for name in self.names:
            self.service.index.add_backend(name)
        self.backends = [
            BackendState(name=name, url=f"http://127.0.0.1:{9000 + i}") for i, name in enumerate(self.names)
        ]
        self.policy = KVAware(KVAwarePolicy(), self.service, None)
        self.decoder = msgspec.json.Decoder()

    def route(self, body: bytes, session_id: str | None = None) -> tuple[Any, Any, tuple[float, ...]]:
        """(the prompt's tokens, the chosen backend, seconds of each step in STEPS) for one body."""
        from router.index.keys import Namespace, prompt_prefix_keys
        from router.policies.base import RouteRequest

        t0 = time.perf_counter()
        data = self.decoder.decode(body)
        t1 = time.perf_counter()
        text = self.tokenizer.render_chat(data)
        t2 = time.perf_counter()
        tokens = self.tokenizer.encode_text(text, add_special_tokens=False)
        t3 = time.perf_counter()
        prompt_prefix_keys(tokens, (None, None))
        t4 = time.perf_counter()
        self.service.longest_cached_prefix(tokens, (None, None), self.names)
        t5 = time.perf_counter()
        route = RouteRequest("r", self.model, data, session_id, tokens, Namespace())
        choice = self.policy.choose(route, self.backends)
        self.policy.on_routed(choice)
        chosen = choice.backend
        t6 = time.perf_counter()
        return tokens, chosen, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)


def stage_breakdown(workload_name: str, users: int, turns: int, engines: int) -> dict:
    """Median and p90 microseconds of each request-path step of this process's `router` code."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from kvwire import BlockStored

    ordered = build_workload(workload_name, users, turns, seed=7)
    kinds = request_kinds(ordered)
    path = RequestPathSteps(engines)
    tokenizer = path.tokenizer
    executor = ThreadPoolExecutor(max_workers=1)
    steps = (*RequestPathSteps.STEPS, "thread_hop")
    samples: dict[str, dict[str, list[float]]] = {step: {kind: [] for kind in KINDS} for step in steps}
    next_hash = 1

    async def hop() -> float:
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(executor, int)
        return time.perf_counter() - started

    loop = asyncio.new_event_loop()
    for request, kind in zip(ordered, kinds, strict=True):
        tokens, chosen, spans = path.route(_request_body(request), request.session_id)
        hop_s = loop.run_until_complete(hop())
        if list(tokens) != list(request.prompt_token_ids):
            raise AssertionError(f"request {request.index}: tokens differ from the workload's")
        for step, seconds in zip(steps, (*spans, hop_s), strict=True):
            samples[step][kind].append(seconds * 1e6)
        # The engine caches what it was sent: its events, as the subscriber would apply them.
        full = len(tokens) // 16 * 16
        hashes = list(range(next_hash, next_hash + full // 16))
        next_hash += len(hashes)
        path.service.writer.apply(
            chosen.name,
            [BlockStored(block_hashes=hashes, token_ids=tokens[:full].tolist(), block_size=16)],
        )
    loop.close()
    executor.shutdown()
    # Encode cost per character, uncached text, for where the thread hop pays (router/tokenize/request.py).
    text = tokenizer.render_chat({"messages": ordered[-1].messages})
    encoders = {"tokenizer": lambda: tokenizer.tokenizer.encode(text, add_special_tokens=False)}
    ascii_encoder = getattr(tokenizer, "_ascii", None)
    if ascii_encoder is not None:
        encoders["ascii_fast_path"] = lambda: ascii_encoder.encode(text)
    rates = {}
    for name, encode in encoders.items():
        times = []
        for _ in range(7):
            started = time.perf_counter()
            encode()
            times.append(time.perf_counter() - started)
        rates[f"{name}_us_per_char"] = round(statistics.median(times) * 1e6 / len(text), 3)
    steps_out = {
        step: {
            kind: {
                "p50_us": round(statistics.median(values), 1),
                "p90_us": round(_percentile(values, 90), 1),
                "count": len(values),
            }
            for kind, values in by_kind.items()
        }
        for step, by_kind in samples.items()
    }
    return {"steps": steps_out, "encode_rates": rates}


def run_stages(tree: Path, args: argparse.Namespace) -> dict:
    """stage_breakdown() in a child process that imports `router` from `tree`, run by the tree's own
    copy of this benchmark where it has one (the stages call the tree's own internal names, which
    a refactor may have moved)."""
    own_script = tree / "benchmarks" / "kv_aware_latency.py"
    script = own_script if own_script.exists() else Path(__file__).resolve()
    command = [
        sys.executable, str(script), "--stages-only", "--tree", str(tree),
        "--users", str(args.users), "--turns", str(args.turns), "--engines", str(args.engines),
        "--workload", args.workload,
    ]  # fmt: skip
    # The tree's own script finds its own helpers; this one needs this checkout's.
    env = dict(os.environ, PYTHONPATH=str(tree) if script == own_script else f"{tree}{os.pathsep}{REPO_ROOT}")
    output = subprocess.run(command, env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


# ---------------------------------------------------------------- live run


class _Client:
    """One keep-alive HTTP/1.1 connection (http.client: little client-side work per request)."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=30)

    def post(self, body: bytes) -> tuple[float, str]:
        started = time.perf_counter()
        self.connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = self.connection.getresponse()
        payload = response.read()
        elapsed = time.perf_counter() - started
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
        return elapsed, response.getheader("x-kvgate-backend") or ""

    def close(self) -> None:
        self.connection.close()


def _metric_sum_count(url: str, name: str) -> tuple[float, float]:
    import httpx

    total = count = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


def _wait_until_idle(processes: list, tree_cpu_seconds, timeout_s: float = 120.0) -> None:
    """Until every gateway has applied the KV events of the untimed sends: each uses under 5% of a
    core over half a second (a fixed pause was not enough for document_qa's ~200k blocks a gateway)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        before = [tree_cpu_seconds(process.pid) for process in processes]
        time.sleep(0.5)
        used_since = [tree_cpu_seconds(p.pid) - used for p, used in zip(processes, before, strict=True)]
        if all(seconds < 0.025 for seconds in used_since):
            return
    raise TimeoutError(f"gateways still busy {timeout_s} s after the untimed sends (KV events not applied)")


def live_run(gateways: list[tuple[str, Path, str]], args: argparse.Namespace) -> dict:
    from kvgate_testing.proc_stats import tree_cpu_seconds
    from kvgate_testing.sim_fleet import EngineFleet
    from kvgate_testing.source_trees import start_tree_gateway

    requests = build_workload(args.workload, args.users, args.turns, seed=11)
    kinds = request_kinds(requests)
    warmup = build_workload(args.workload, 2, 2, seed=12)
    fleet = EngineFleet(
        args.engines, num_gpu_blocks=8192, sim_args=[*INSTANT_ENGINE, "--log-level", "warning"]
    )
    started: list = []
    try:
        fleet.start()
        targets: list[tuple[str, object, _Client]] = []
        urls: dict[str, str] = {}
        for label, tree, policy in gateways:
            process, urls[label] = start_tree_gateway(tree, fleet, f"kvgate-latency-{label}-", policy)
            started.append(process)
            targets.append((label, process, _Client(urls[label])))
        directs = [_Client(engine.url) for engine in fleet.engines]
        for request in warmup:
            body = _request_body(request)
            for _, _, client in targets:
                client.post(body)
            directs[0].post(body)
        # Every engine sees every prompt once, untimed: its own tokenizer cache then answers each
        # timed send alike whichever engine gets it, and the KV events of the workload are all in
        # before the measured phase, so the gateways' CPU there is their request path alone.
        for request in requests:
            body = _request_body(request)
            for client in directs:
                client.post(body)
        _wait_until_idle([process for _, process, _ in targets], tree_cpu_seconds)
        overhead_before = {label: _metric_sum_count(url, OVERHEAD_METRIC) for label, url in urls.items()}
        cpu_before = {label: tree_cpu_seconds(process.pid) for label, process, _ in targets}
        latencies: dict[str, dict[str, list[float]]] = {
            name: {kind: [] for kind in KINDS} for name in ["direct", *(label for label, *_ in targets)]
        }
        added: dict[str, dict[str, list[float]]] = {
            label: {kind: [] for kind in KINDS} for label, *_ in targets
        }
        for number, (request, kind) in enumerate(zip(requests, kinds, strict=True)):
            body = _request_body(request)
            direct = directs[int(request.session_id.rsplit("-", 1)[1]) % len(directs)]
            order = [("direct", direct), *((label, client) for label, _, client in targets)]
            shift = number % len(order)
            measured: dict[str, float] = {}
            for name, client in order[shift:] + order[:shift]:
                measured[name], _ = client.post(body)
            for name, seconds in measured.items():
                latencies[name][kind].append(seconds * 1e3)
                if name != "direct":
                    added[name][kind].append((seconds - measured["direct"]) * 1e3)
        cpu = {label: tree_cpu_seconds(process.pid) - cpu_before[label] for label, process, _ in targets}
        overhead_after = {label: _metric_sum_count(url, OVERHEAD_METRIC) for label, url in urls.items()}
        for _, _, client in targets:
            client.close()
        for client in directs:
            client.close()
    finally:
        for process in started:
            process.stop()
        fleet.stop()
    count = {kind: len(latencies["direct"][kind]) for kind in KINDS}
    result: dict = {"requests": count, "gateways": {}}
    result["direct"] = {
        kind: {"p50_ms": _percentile(v, 50), "p90_ms": _percentile(v, 90)}
        for kind, v in latencies["direct"].items()
    }
    for label, *_ in targets:
        total_s, total_n = (a - b for a, b in zip(overhead_after[label], overhead_before[label], strict=True))
        result["gateways"][label] = {
            "added_ms": {
                kind: {
                    "p50": round(_percentile(added[label][kind], 50), 3),
                    "p90": round(_percentile(added[label][kind], 90), 3),
                }
                for kind in KINDS
            },
            "latency_ms": {
                kind: {
                    "p50": round(_percentile(latencies[label][kind], 50), 3),
                    "p90": round(_percentile(latencies[label][kind], 90), 3),
                }
                for kind in KINDS
            },
            "cpu_ms_per_request": round(cpu[label] * 1e3 / sum(count.values()), 3),
            "gateway_overhead_mean_ms": round(total_s / total_n * 1e3, 3) if total_n else None,
        }
    return result


# ---------------------------------------------------------------- report


def write_markdown(results: dict, path: Path) -> None:
    gateways = results["gateways"]
    lines = [
        "# kv_aware request path: added latency and CPU per request",
        "",
        f"Run {results['when']} with `{results['command']}` ({results['wall_s']:.0f} s wall).",
        f"Machine: {results['machine']}; load average (1 min) {results['load_start']:.2f} at the start, "
        f"{results['load_end']:.2f} at the end (other sessions share the 2 cores).",
        f"{results['engines']} simulated engines answering at once; {results['workload']} with "
        f"{results['users']} sessions (chats or documents) x {results['turns']} requests (turns or "
        "questions), sent one request at a time to every "
        "gateway and straight to an engine (rotating order); non-streamed, one output token. "
        "First turn: a session's first request (a chat's first turn, a document's first question); "
        "follow-up: its later ones.",
        "",
        "Gateways (source trees, kv_aware with the real Qwen3 tokenizer and every engine's KV events; "
        "the reference policy, when listed, reads neither):",
        "",
        *(f"- **{label}**: `{tree}`" + (f" ({rev})" if rev else "") for label, tree, rev in results["trees"]),
        "",
        "## Added latency and CPU",
        "",
        "Added = gateway latency minus direct latency, per request (ms); CPU = utime+stime of the gateway "
        "process per request over the measured phase (the workload's KV events were all applied before "
        "it: every prompt is cached on every engine, so each lookup finds it everywhere); overhead = the "
        "gateway's own kvgate_gateway_overhead_seconds, mean.",
        "",
        "| gateway | first turn added p50 | p90 | follow-up added p50 | p90 | CPU ms/request "
        "| overhead mean ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, entry in gateways.items():
        added = entry["added_ms"]
        lines.append(
            f"| {label} | {added['first_turn']['p50']:.2f} | {added['first_turn']['p90']:.2f} | "
            f"{added['follow_up']['p50']:.2f} | {added['follow_up']['p90']:.2f} | "
            f"{entry['cpu_ms_per_request']:.2f} | {entry['gateway_overhead_mean_ms']:.2f} |"
        )
    direct = results["direct"]
    lines += [
        "",
        f"Direct latency p50: first turns {direct['first_turn']['p50_ms']:.2f} ms, follow-ups "
        f"{direct['follow_up']['p50_ms']:.2f} ms ({results['requests']['first_turn']} first turns, "
        f"{results['requests']['follow_up']} follow-ups).",
        "",
        "## Where the time goes (stages, µs, p50 / p90)",
        "",
        "Each tree's own code in a child process, on the same prompts (in-process, no HTTP): parse = "
        "msgspec decode of the body; render = chat template; encode = tokens of the rendered text "
        "(per-piece cache); keys = router keys of the prompt; lookup = index lookup over the engines; "
        "policy = kv_aware choose + on_routed; thread_hop = one round trip to a tokenizer thread.",
        "",
    ]
    labels = list(results["stages"])
    header = "| step | " + " | ".join(f"{label} first turn | {label} follow-up" for label in labels) + " |"
    lines += [header, "|---|" + "---:|" * (2 * len(labels))]
    steps = list(next(iter(results["stages"].values()))["steps"])
    for step in steps:
        cells = []
        for label in labels:
            for kind in KINDS:
                value = results["stages"][label]["steps"][step][kind]
                cells.append(f"{value['p50_us']:.0f} / {value['p90_us']:.0f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Encoding cost of uncached text, µs per character (the last prompt, warm pretoken cache):",
        "",
    ]
    for label in labels:
        rates = ", ".join(
            f"{name} {value}" for name, value in results["stages"][label]["encode_rates"].items()
        )
        lines.append(f"- {label}: {rates}")
    if results.get("notes"):
        lines += ["", "## Notes", "", *(f"- {note}" for note in results["notes"])]
    path.write_text("\n".join(lines) + "\n")


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results["gateways"])
    figure, (latency_axis, cpu_axis) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(labels))
    groups = [(kind, q) for kind in KINDS for q in ("p50", "p90")]
    for position, label in enumerate(labels):
        values = [results["gateways"][label]["added_ms"][kind][q] for kind, q in groups]
        latency_axis.bar([i + position * width for i in range(len(groups))], values, width, label=label)
    latency_axis.set_xticks([i + width * (len(labels) - 1) / 2 for i in range(len(groups))])
    latency_axis.set_xticklabels([f"{kind.replace('_', ' ')}\n{q}" for kind, q in groups])
    latency_axis.set_ylabel("latency added by the gateway (ms)")
    latency_axis.legend()
    cpu_axis.bar(labels, [results["gateways"][label]["cpu_ms_per_request"] for label in labels], color="C2")
    cpu_axis.set_ylabel("gateway CPU per request (ms)")
    figure.suptitle(f"kv_aware request path ({results['engines']} simulated engines, chat sessions)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gateway", action="append", default=[], metavar="LABEL=DIR", help="a source tree to run"
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--workload", choices=("chat_sessions", "document_qa"), default="chat_sessions")
    parser.add_argument("--users", type=int, default=32, help="chat sessions, or documents")
    parser.add_argument("--turns", type=int, default=4, help="turns per chat, or questions per document")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", help="results file name without extension (default: from the workload)")
    parser.add_argument(
        "--reference-policy",
        default="least_loaded",
        help="also run the last tree under this policy (no tokens, no KV events); '' for none",
    )
    parser.add_argument("--note", action="append", default=[], help="a line for the report's notes")
    parser.add_argument("--stages-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stages_only:  # run_stages's child: PYTHONPATH puts `--tree` first, then this checkout
        print(json.dumps(stage_breakdown(args.workload, args.users, args.turns, args.engines)))
        return 0
    from kvgate_testing.source_trees import parse_gateway_trees, tree_revision

    try:
        gateways = parse_gateway_trees(args.gateway, default=("this tree", REPO_ROOT))
    except ValueError as exc:
        parser.error(str(exc))
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    results: dict = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python -m benchmarks.kv_aware_latency "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
        "engines": args.engines,
        "workload": args.workload,
        "users": args.users,
        "turns": args.turns,
        "load_start": load_start,
        "trees": [(label, str(tree), tree_revision(tree)) for label, tree in gateways],
        "notes": args.note,
    }
    print("stage breakdown ...", file=sys.stderr, flush=True)
    results["stages"] = {label: run_stages(tree, args) for label, tree in gateways}
    targets = [(label, tree, "kv_aware") for label, tree in gateways]
    if args.reference_policy:
        # The last tree under a policy that needs no tokens: what every request costs anyway.
        label, tree = gateways[-1]
        targets.append((f"{label} {args.reference_policy}", tree, args.reference_policy))
    print("live run ...", file=sys.stderr, flush=True)
    results.update(live_run(targets, args))
    results["load_end"] = os.getloadavg()[0]
    results["wall_s"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or (
        "kv_aware_latency" if args.workload == "chat_sessions" else f"kv_aware_latency_{args.workload}"
    )
    (args.out / f"{name}.json").write_text(json.dumps(with_source(results), indent=2) + "\n")
    write_markdown(results, args.out / f"{name}.md")
    write_plot(results, args.out / f"{name}.png")
    print((args.out / f"{name}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
