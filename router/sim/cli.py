"""`kvgate sim`: run one simulated vLLM-compatible engine (flags named as vLLM's where vLLM has them)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys

from kvwire import ENCODINGS, EventPublisher, parse_kv_events_config

log = logging.getLogger("kvgate.sim")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-qwen3", help="model name served")
    parser.add_argument("--served-model-name", default=None, help="served name, overriding --model (as vLLM)")
    parser.add_argument("--tokenizer", default="builtin:qwen3", help="tokenizer directory or builtin:qwen3")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--hash-seed",
        type=int,
        default=None,
        help="seed of the block hashes' chain (as PYTHONHASHSEED seeds vLLM's): engines with other "
        "seeds announce other hashes for the same blocks (what the gateway's contract check detects)",
    )
    parser.add_argument("--num-gpu-blocks-override", type=int, default=2048, help="KV blocks in the pool")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    parser.add_argument("--max-model-len", type=int, default=32768, help="longest prompt + output, in tokens")
    parser.add_argument("--kv-events-config", default=None, help="vLLM's KVEventsConfig as JSON")
    parser.add_argument(
        "--kv-events-encoding",
        choices=ENCODINGS,
        default="vllm",
        help="vllm: map events (vLLM >= 0.24); vllm-array: array events (vLLM <= 0.22); sglang: SGLang's",
    )
    parser.add_argument(
        "--prefill-us-per-token", type=float, default=50.0, help="prefill cost per uncached token"
    )
    parser.add_argument(
        "--prefill-overhead-ms", type=float, default=2.0, help="fixed prefill cost per request"
    )
    parser.add_argument(
        "--decode-ms-per-token", type=float, default=5.0, help="decode cost per token, batch of 1"
    )
    parser.add_argument(
        "--decode-batch-slope",
        type=float,
        default=0.05,
        help="extra decode ms per token per other running sequence",
    )
    parser.add_argument(
        "--shared-tier",
        default=None,
        metavar="NAME",
        help="join the simulated shared KV tier NAME (engines of one name share one store; their KV "
        'events report its blocks with medium "shared"); needs --shared-tier-url',
    )
    parser.add_argument(
        "--shared-tier-url", default=None, help="redis:// URL of the Redis holding the simulated shared tier"
    )
    parser.add_argument(
        "--shared-tier-removals",
        action="store_true",
        help="announce the blocks the shared tier's Redis evicts, expires or deletes as removed, and a "
        "restarted Redis as a clear of the shared medium (needs the server's notify-keyspace-events "
        "to include Exeg); without it the engine never hears of a loss",
    )
    parser.add_argument(
        "--shared-block-bytes",
        type=int,
        default=1,
        help="bytes each block takes in the shared tier's Redis (filler standing for its KV), which a "
        "server under maxmemory counts",
    )
    parser.add_argument(
        "--shared-load-us-per-token",
        type=float,
        default=10.0,
        help="cost of loading one prompt token's KV from the shared tier instead of computing it",
    )
    parser.add_argument(
        "--shared-store-us-per-token",
        type=float,
        default=0.0,
        help="time a write of one prompt token's KV into the shared tier takes before it lands",
    )
    parser.add_argument(
        "--prefill-blocks-decode",
        action="store_true",
        help="a decode step waits for the prefills being computed (one accelerator, no chunked "
        "prefill): a long prompt stalls the streams decoding on the engine",
    )
    parser.add_argument(
        "--kv-role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="what the engine does with the shared tier, as vLLM's kv_producer/kv_consumer: prefill "
        "stores each prompt before answering, decode only loads, both loads and stores in the background",
    )
    parser.add_argument(
        "--unannounced-prefix-cache-reset",
        action="store_true",
        help="a fault for tests: POST /reset_prefix_cache empties the cache but publishes no "
        "AllBlocksCleared, so a router's index keeps crediting the lost blocks (a stale index) while "
        "the usage reports the truth, fewer cached tokens",
    )
    parser.add_argument(
        "--default-max-tokens", type=int, default=16, help="max_tokens when a request gives none"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters served under their own names (nothing is loaded; their blocks hash apart)",
    )
    # Accepted for command-line compatibility with vLLM; the simulator always behaves this way.
    for flag in (
        "--enable-prompt-tokens-details",
        "--enable-prefix-caching",
        "--enforce-eager",
        "--enable-lora",
    ):
        parser.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


def _refuse(message: str) -> int:
    """Say why the simulator cannot start, on stderr; the exit status of a bad command line."""
    print(f"kvgate sim: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.hash_seed is not None:
        from router.sim.blocks import set_hash_seed

        set_hash_seed(args.hash_seed)
    """Start the simulated engine and serve until interrupted."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name, value, minimum in (
        ("--port", args.port, 0),
        ("--block-size", args.block_size, 1),
        ("--num-gpu-blocks-override", args.num_gpu_blocks_override, 1),
        ("--max-num-seqs", args.max_num_seqs, 1),
        ("--max-model-len", args.max_model_len, 2),
        ("--default-max-tokens", args.default_max_tokens, 1),
    ):
        if value < minimum:
            return _refuse(f"{name} must be at least {minimum}, got {value}")
    try:
        lora_names = _lora_names(args.lora_modules)
    except ValueError as exc:
        return _refuse(str(exc))
    if bool(args.shared_tier) != bool(args.shared_tier_url):
        return _refuse("--shared-tier and --shared-tier-url go together; give both or neither")
    if args.shared_tier_removals and not args.shared_tier:
        return _refuse("--shared-tier-removals watches a shared tier; give --shared-tier")
    if args.kv_role != "both" and not args.shared_tier:
        return _refuse(f"--kv-role {args.kv_role} hands KV over through a shared tier; give --shared-tier")
    if args.shared_load_us_per_token < 0:
        return _refuse("--shared-load-us-per-token must not be negative")
    if args.shared_store_us_per_token < 0:
        return _refuse("--shared-store-us-per-token must not be negative")
    events_config = None
    if args.kv_events_config:
        try:
            events_config = parse_kv_events_config(args.kv_events_config)
        except ValueError as exc:
            return _refuse(str(exc))

    import uvicorn  # imported here so `kvgate --help` stays fast

    from router.sim.api import ServedModel, build_app
    from router.sim.blocks import BlockPool
    from router.sim.engine import SimulatedEngine, TimingModel
    from router.sim.prompts import PromptTokenizer, resolve_tokenizer_dir
    from router.sim.shared_store import SharedBlockStore

    try:
        tokenizer = PromptTokenizer(resolve_tokenizer_dir(args.tokenizer))
    except (ValueError, OSError) as exc:
        return _refuse(f"cannot load the tokenizer {args.tokenizer!r}: {exc}")
    model_name = args.served_model_name or args.model
    timing = TimingModel(
        prefill_us_per_token=args.prefill_us_per_token,
        prefill_overhead_ms=args.prefill_overhead_ms,
        decode_ms_per_token=args.decode_ms_per_token,
        decode_batch_slope_ms=args.decode_batch_slope,
        shared_load_us_per_token=args.shared_load_us_per_token,
        shared_store_us_per_token=args.shared_store_us_per_token,
        prefill_blocks_decode=args.prefill_blocks_decode,
    )
    shared_store = None
    if args.shared_tier:
        try:
            shared_store = SharedBlockStore(
                args.shared_tier_url, args.shared_tier, block_bytes=args.shared_block_bytes
            )
        except ValueError as exc:
            return _refuse(str(exc))
    publisher = None
    if (
        events_config is not None
        and events_config.enable_kv_cache_events
        and events_config.publisher == "zmq"
    ):
        try:
            # Unlike vLLM, which connects its PUB socket unless the endpoint holds a wildcard, the
            # simulator always binds: its endpoints are loopback addresses the gateway connects to.
            publisher = EventPublisher(
                events_config.endpoint,
                events_config.replay_endpoint,
                topic=events_config.topic,
                encoding=args.kv_events_encoding,
                data_parallel_rank=0,
                buffer_steps=events_config.buffer_steps,
                hwm=events_config.hwm,
                bind=True,
            )
        except OSError as exc:
            return _refuse(str(exc))
    engine = SimulatedEngine(
        BlockPool(args.num_gpu_blocks_override, args.block_size),
        timing,
        tokenizer.output_vocabulary,
        args.max_num_seqs,
        publisher,
        shared_store,
        args.kv_role,
        args.shared_tier_removals,
        args.unannounced_prefix_cache_reset,
    )
    app = build_app(
        engine,
        tokenizer,
        ServedModel(model_name, args.max_model_len, args.default_max_tokens, lora_names),
    )
    log.warning(
        "SIMULATED engine (no model runs here): serving %r on http://%s:%d, %d KV blocks of %d tokens, "
        "KV events %s (%s encoding); prefill %.1f us/token, decode %.2f ms/token; shared tier %s, "
        "kv role %s",
        model_name,
        args.host,
        args.port,
        args.num_gpu_blocks_override,
        args.block_size,
        events_config.endpoint if publisher and events_config else "off",
        args.kv_events_encoding,
        args.prefill_us_per_token,
        args.decode_ms_per_token,
        f"{args.shared_tier!r} ({args.shared_load_us_per_token} us/token)" if shared_store else "off",
        args.kv_role,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        loop="auto",
        http="auto",
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.Server(config).run()
    finally:
        if publisher is not None:
            publisher.close()
    return 0


def _lora_names(modules: list[str]) -> tuple[str, ...]:
    """Names from vLLM's --lora-modules values: `name=path` or JSON `{"name": ..., "path": ...}`."""
    names = []
    for module in modules:
        if module.lstrip().startswith("{"):
            try:
                name = json.loads(module)["name"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {module!r}: JSON form needs a "name" key') from None
        else:
            name, separator, _ = module.partition("=")
            if not separator or not name:
                raise ValueError(f"--lora-modules {module!r}: expected NAME=PATH")
        names.append(name)
    return tuple(names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvgate sim", description="Run one simulated vLLM-compatible engine."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
