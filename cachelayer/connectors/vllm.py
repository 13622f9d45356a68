"""The cache layer as a vLLM (0.32, V1) KV connector: `CacheLayerConnector`.

Load it with
`--kv-transfer-config '{"kv_connector": "CacheLayerConnector", "kv_connector_module_path":
"cachelayer.connectors.vllm", "kv_role": "kv_both"}'` and a CACHELAYER_CONFIG_FILE; add
`"kv_connector_extra_config": {"cachelayer_server": "tcp://HOST:PORT"}` to use the shared daemon
(`cachelayer server`) instead of a store inside the worker.

Roles (`kv_role`): `kv_both` loads and saves (saves finish in the background); `kv_consumer` (a
decode engine) loads and never saves; `kv_producer` (a prefill engine) loads, and saves every
prompt as a handoff: the worker stores it before the step that computed it returns, so the
request's first token, and with it the answer, leaves the engine only once the store holds the
prompt. A `kv_both` engine saves a request marked `kv_transfer_params: {"do_remote_decode": true}`
the same way. The answer's `kv_transfer_params` report `stored_tokens`/`store_seconds` and
`loaded_tokens`/`load_seconds`, which kvgate's gateway learns its costs from.
`"async_load": true` in kv_connector_extra_config loads in a background thread while the
request waits off the batch (vLLM's asynchronous load, reported through get_finished).

vLLM makes two instances that share no memory: one in the scheduler process (plans loads and
saves, answers how many tokens the cache holds) and one per worker (moves KV). The scheduler side
asks the store over ZMQ: the daemon in daemon mode, or, in the in-process mode, the worker's own
CacheEngine, which the worker serves on an ipc:// socket named after the engine id. Planning
lives in cachelayer.connectors.planning, KV moves in cachelayer.connectors.transfers; this
module adapts them to vLLM's hooks. docs/vllm.md describes the design.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cachelayer.config import load_config
from cachelayer.connectors.planning import SchedulerPlanner, StepPlan
from cachelayer.connectors.transfers import (
    BackgroundLoader,
    BackgroundSaver,
    ChunkStore,
    LocalChunkStore,
    PagedKV,
    RemoteChunkStore,
    RequestLoad,
    detect_layout,
    store_now,
)
from cachelayer.controller.auth import secret_from_env
from cachelayer.server.client import StoreClient, StoreUnavailable
from cachelayer.server.daemon import StoreServer
from cachelayer.server.protocol import ChunkEvent, FeedEvent, KeySpace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# A child of vLLM's logger, so these lines appear in the engine's log with its format and level.
log = logging.getLogger("vllm.cachelayer_connector")

SERVER_KEY = "cachelayer_server"
# LMCache's name for the same switch, so an LMCache user's kv_connector_extra_config carries over.
LAYERWISE_KEY = "use_layerwise"
# Load in the background while the request waits off the batch (vLLM's asynchronous load).
ASYNC_LOAD_KEY = "async_load"
# How long a step with nothing scheduled waits for an asynchronous load to finish before it
# returns (vLLM steps again at once: without the wait, the engine spins while the load runs).
ASYNC_IDLE_WAIT_S = 0.01
# Medium of the cache layer's chunks in vLLM's KV-event stream (vLLM's own blocks say "GPU"):
# the worker's own store is this engine's CPU tier; the daemon's store is shared by every engine
# attached to it, and the remote tier (Redis) by every engine configured with it. A router told
# which backends share a tier (kvgate's `shared_tiers`) credits those chunks to all of them.
EVENT_MEDIUM = "CPU"
SHARED_DAEMON_MEDIUM = "SHARED"
REMOTE_MEDIUM = "REMOTE"
# Set to a file path to get one JSON line per hook call with its duration (benchmarks read it).
TIMINGS_ENV = "CACHELAYER_CONNECTOR_TIMINGS"
# How long a handoff save waits for the remote tier to take the prompt (in-process store only).
HANDOFF_FLUSH_KEY = "cachelayer_handoff_flush_s"
# The request field (vLLM's, from its prefill/decode protocol) that marks a prefill whose decode
# runs on another engine.
REMOTE_DECODE_FIELD = "do_remote_decode"
# Finished requests' kv_transfer_params still open for the worker's figures of their last step.
OPEN_PARAMS_KEPT = 1024


# ---- the cache identity contract ----


def _attention_spec(kv_cache_config: KVCacheConfig | None) -> Any:
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return None
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec


def kv_layout_name(vllm_config: VllmConfig, dtype: torch.dtype, head_dim: int) -> str:
    """The layout of the KV bytes this engine stores: part of the key space.

    The CPU backend's blocks are stored as the engine's own bytes, packed per instruction set
    (amx, vec...), so its layout names the ISA; the CUDA layouts store plain K/V rows.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(dtype, vllm_config.cache_config.block_size, head_dim)
        except Exception:  # a private helper of vLLM: without it, name the layout alone
            isa = "unknown"
        return f"cpu_blocks:{isa}"
    return "token_rows"


def key_space(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, worker_id: int = 0) -> KeySpace:
    """The key space both sides of this engine use: model and revision, block size, KV layout,
    KV dtype and shape, TP size and rank. A store written under another key space is a miss."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    spec = _attention_spec(kv_cache_config)
    if spec is not None and hasattr(spec, "num_kv_heads"):
        num_kv_heads, head_dim, dtype = spec.num_kv_heads, spec.head_size, spec.dtype
        num_layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
    else:
        num_kv_heads = model_config.get_num_kv_heads(parallel_config)
        head_dim = model_config.get_head_size()
        num_layers = model_config.get_num_layers(parallel_config)
        dtype = model_config.dtype
    block_size = vllm_config.cache_config.block_size
    layout = kv_layout_name(vllm_config, dtype, head_dim)
    identity = (
        f"{model_config.model}@{model_config.revision or 'default'}|block_size={block_size}|layout={layout}"
    )
    return KeySpace(
        model=identity,
        dtype=str(dtype).removeprefix("torch."),
        world_size=parallel_config.tensor_parallel_size,
        worker_id=worker_id,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )


def in_process_endpoint(vllm_config: VllmConfig) -> str:
    """The ipc:// socket where the worker serves its store to the scheduler (in-process mode)."""
    engine_id = re.sub(r"[^A-Za-z0-9_-]", "", str(vllm_config.kv_transfer_config.engine_id))[:32]
    return f"ipc://{tempfile.gettempdir()}/cachelayer-{engine_id}.sock"


def _layer_index(name: str) -> tuple[int, str]:
    numbers = re.findall(r"\d+", name)
    return (int(numbers[-1]) if numbers else 0, name)


# ---- what travels from the scheduler to the workers, and back ----


@dataclass
class CacheLayerConnectorMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)
    # The step runs no forward pass (nothing scheduled, e.g. only asynchronous loads pending).
    idle: bool = False


@dataclass
class CacheLayerWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers moved this step, per request: `loaded_tokens`, `load_seconds` (a load),
    `stored_tokens`, `store_seconds` (a handoff save). Across TP ranks: the fewest tokens and
    the longest time, since the request needs every rank's shard."""

    transfers: dict[str, dict[str, float]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> CacheLayerWorkerMetadata:
        if isinstance(other, CacheLayerWorkerMetadata):
            for request_id, figures in other.transfers.items():
                mine = self.transfers.setdefault(request_id, dict(figures))
                for key, value in figures.items():
                    pick = max if key.endswith("_seconds") else min
                    mine[key] = pick(mine.get(key, value), value)
        return self


class CacheLayerKVEvents(KVConnectorKVEvents):
    """The chunks a worker stored or evicted this step, as vLLM KV events (medium "CPU").

    Only TP rank 0 reports (every rank stores its own shard under its own keys), so the
    scheduler side takes the events as they come instead of keeping those common to all ranks.
    """

    def __init__(self, events: list[KVCacheEvent] | None = None) -> None:
        self._events: list[KVCacheEvent] = list(events or [])
        self._workers = 1

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> CacheLayerKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()


class MediumCleared(KVCacheEvent, tag="AllBlocksCleared"):
    """vLLM's AllBlocksCleared with kvgate's `medium` (kvwire.AllBlocksCleared): everything this
    engine announced in one medium is gone. Sent when the shared daemon restarted (its store is
    empty), so a router forgets the engine's "SHARED" chunks and keeps its GPU blocks; a reader
    that knows no medium on a clear (vLLM's decoder ignores the trailing field) clears everything,
    which errs towards a miss, never a false hit."""

    medium: str | None = None


def _block_stored(
    block_hashes: Sequence[Any],
    parent_block_hash: Any,
    token_ids: Sequence[int],
    medium: str,
    extra_keys: list[Any] | None,
    *,
    block_size: int | None = None,
) -> BlockStored:
    """vLLM's BlockStored for stored tokens of no LoRA adapter; `block_size` is the number of
    tokens unless the event says otherwise."""
    return BlockStored(
        block_hashes=list(block_hashes),
        parent_block_hash=parent_block_hash,
        token_ids=list(token_ids),
        block_size=len(token_ids) if block_size is None else block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=extra_keys,
    )


def to_vllm_events(
    chunk_events: list[ChunkEvent], cache_salt: str | None, medium: str = EVENT_MEDIUM
) -> list[KVCacheEvent]:
    """Chunk events of the store as vLLM KV events; a salted chain's first chunk carries its salt
    in extra_keys, as vLLM's own events do, so a router can keep salted prefixes apart."""
    events: list[KVCacheEvent] = []
    for chunk in chunk_events:
        if chunk.kind == "stored":
            extra_keys = [(cache_salt,)] if cache_salt is not None and chunk.parent_key is None else None
            events.append(_block_stored([chunk.key], chunk.parent_key, chunk.token_ids, medium, extra_keys))
        else:
            events.append(BlockRemoved(block_hashes=[chunk.key], medium=medium))
    return events


def remote_tier_events(events: list[Any]) -> list[KVCacheEvent]:
    """The cache layer's own events for its remote tier (written there behind the store) as vLLM
    KV events of medium REMOTE; the other tiers' events reach vLLM through the saves."""
    converted: list[KVCacheEvent] = []
    for event in events:
        if getattr(event, "medium", None) != "remote":
            continue
        if hasattr(event, "token_ids"):
            converted.append(
                _block_stored(
                    event.block_hashes,
                    event.parent_block_hash,
                    event.token_ids,
                    REMOTE_MEDIUM,
                    event.extra_keys,
                    block_size=event.block_size,
                )
            )
        else:
            converted.append(BlockRemoved(block_hashes=list(event.block_hashes), medium=REMOTE_MEDIUM))
    return converted


def remote_feed_events(feed: list[FeedEvent]) -> list[KVCacheEvent]:
    """The shared daemon's remote-tier feed (cachelayer.server.remote_feed) as vLLM KV events of
    medium REMOTE, as an engine-local remote tier announces them: "cleared" (the daemon restarted,
    or the feed overflowed) becomes a one-medium AllBlocksCleared."""
    converted: list[KVCacheEvent] = []
    for event in feed:
        if event.kind == "stored":
            extra_keys = [(event.cache_salt,)] if event.cache_salt is not None else None
            converted.append(
                _block_stored([event.key], event.parent_key, event.token_ids, REMOTE_MEDIUM, extra_keys)
            )
        elif event.kind == "removed":
            converted.append(BlockRemoved(block_hashes=[event.key], medium=REMOTE_MEDIUM))
        else:
            converted.append(MediumCleared(medium=REMOTE_MEDIUM))
    return converted


class _HookTimings:
    """Accumulated seconds per hook; written as JSON lines when TIMINGS_ENV names a file."""

    def __init__(self, role: str) -> None:
        self.path = os.environ.get(TIMINGS_ENV)
        self.role = role
        self.lock = threading.Lock()

    def record(self, hook: str, started: float, **details: Any) -> None:
        if self.path:
            self.record_seconds(hook, time.perf_counter() - started, **details)

    def record_seconds(self, hook: str, seconds: float, **details: Any) -> None:
        if not self.path:
            return
        line = {"role": self.role, "hook": hook, "seconds": seconds, **details}
        with self.lock, open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")


class CacheLayerConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A cache is best effort: a chunk lost between lookup and load must cost a recompute,
            # never a failed request. The scheduler reads this right after creating its connector.
            log.warning("cachelayer: kv_load_failure_policy set to 'recompute' (a failed load recomputes)")
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        self.config = load_config()
        self.block_size = vllm_config.cache_config.block_size
        self.chunk_size = self.config.chunk_size
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.server_endpoint: str | None = extra.get(SERVER_KEY)
        # The shared daemon's secret, from the variable the cache config names (None: no secret).
        self.server_secret = (
            secret_from_env(self.config.server_auth_secret_env, "server_auth_secret_env")
            if self.server_endpoint
            else None
        )
        self.lookup_timeout_s = float(extra.get("cachelayer_timeout_s", 5.0))
        self.layerwise = bool(extra.get(LAYERWISE_KEY, False))
        self.async_load = bool(extra.get(ASYNC_LOAD_KEY, False))
        self.handoff_flush_s = float(extra.get(HANDOFF_FLUSH_KEY, 30.0))
        kv_role = self._kv_transfer_config.kv_role
        # A decode engine never saves; a prefill engine hands every prompt over (see above).
        self.saves = kv_role != "kv_consumer"
        self.producer_only = kv_role == "kv_producer"
        self.timings = _HookTimings("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler(vllm_config, kv_cache_config)
        else:
            self._init_worker(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        # Saves are best effort: a request preempted before its save just misses the cache later.
        return False

    # ======== scheduler side ========

    def _init_scheduler(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        self.planner = SchedulerPlanner(
            chunk_size=self.chunk_size, block_size=self.block_size, saves=self.saves
        )
        # Per request, what the workers reported moving (CacheLayerWorkerMetadata), until it finishes.
        self._transfers: dict[str, dict[str, float]] = {}
        # Finished requests' kv_transfer_params, filled with their last step's figures: vLLM asks
        # request_finished before it hands the connector that step's worker output, and sends the
        # outputs only after both (Scheduler.update_from_output), so the dict can still be filled.
        self._open_params: dict[str, dict[str, Any]] = {}
        self.space = key_space(vllm_config, kv_cache_config, worker_id=0)
        endpoint = self.server_endpoint or in_process_endpoint(vllm_config)
        self.lookup_client = StoreClient(
            endpoint, chunk_size=self.chunk_size, timeout_s=self.lookup_timeout_s, secret=self.server_secret
        )
        self._events: list[KVCacheEvent] = []
        log.info("cachelayer connector (scheduler): store at %s, key space %s", endpoint, self.space)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Layer-by-layer loads wait inside the forward pass (wait_for_layer_load), which a replayed
        # full CUDA graph would skip: vLLM must keep Python between the graph's pieces.
        return bool(extra_config.get(LAYERWISE_KEY, False))

    @staticmethod
    def _cacheable(request: Request) -> bool:
        # KV that depends on more than the tokens and the salt is never shared: no wrong tensors.
        return (
            request.lora_request is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None
            and request.prompt_token_ids is not None
        )

    def _held_tokens(self, request: Request):
        def ask(prefix) -> int:
            try:
                return self.lookup_client.lookup(self.space, list(prefix), cache_salt=request.cache_salt)
            except StoreUnavailable as exc:
                log.warning("cachelayer: lookup failed, treating as a miss: %s", exc)
                return 0

        return ask

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        started = time.perf_counter()
        matched = self.planner.matched_tokens(
            request.request_id,
            request.prompt_token_ids or [],
            num_computed_tokens,
            cacheable=self._cacheable(request),
            held_tokens=self._held_tokens(request),
        )
        self.timings.record(
            "get_num_new_matched_tokens", started, request_id=request.request_id, matched=matched
        )
        # Asynchronous: the request waits off the batch while the worker loads its blocks.
        return matched, self.async_load and matched > 0

    def _handoff(self, request: Request) -> bool:
        """Whether the request's prompt must be in the store before its answer leaves."""
        if self.producer_only:
            return True
        params = getattr(request, "kv_transfer_params", None)
        return self.saves and isinstance(params, dict) and params.get(REMOTE_DECODE_FIELD) is True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        started = time.perf_counter()
        self.planner.allocated(
            request.request_id,
            request.prompt_token_ids or [],
            request.cache_salt,
            blocks.get_block_ids()[0],
            num_external_tokens,
            cacheable=self._cacheable(request),
            handoff=self._handoff(request),
        )
        self.timings.record("update_state_after_alloc", started, request_id=request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        started = time.perf_counter()
        plan = StepPlan()
        if self.async_load:  # requests whose load starts now wait unscheduled
            self.planner.take_pending_loads(plan)
        for new_request in scheduler_output.scheduled_new_reqs:
            self.planner.scheduled(
                new_request.req_id,
                num_computed_tokens=new_request.num_computed_tokens,
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens.get(new_request.req_id, 0),
                block_ids=new_request.block_ids[0],
                plan=plan,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for index, request_id in enumerate(cached.req_ids):
            new_block_ids = cached.new_block_ids[index]
            group_blocks = new_block_ids[0] if new_block_ids is not None else None
            resumed = request_id in cached.resumed_req_ids
            self.planner.scheduled(
                request_id,
                num_computed_tokens=cached.num_computed_tokens[index],
                num_scheduled_tokens=scheduler_output.num_scheduled_tokens.get(request_id, 0),
                block_ids=group_blocks if resumed else None,
                new_block_ids=None if resumed else group_blocks,
                plan=plan,
            )
        if plan.loads or plan.saves:
            self.timings.record("build_connector_meta", started, loads=len(plan.loads), saves=len(plan.saves))
        return CacheLayerConnectorMetadata(plan=plan, idle=scheduler_output.total_num_scheduled_tokens == 0)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Every save is done with the blocks within the step that computed the prompt (a handoff
        # stored, a background save copied out): the blocks may be freed now.
        request_id = request.request_id
        planned_load = self.planner.external_tokens(request_id)
        # What the store is known to hold of the prompt without a save: what was loaded from it.
        held = self.planner.loaded_tokens(request_id) if planned_load else 0
        handoff = self.planner.tracks(request_id) and self._handoff(request)
        self.planner.finished(request_id)
        figures = self._transfers.pop(request_id, {})
        if not (planned_load or handoff or figures):
            return False, None
        params: dict[str, Any] = {}
        if planned_load:
            params["loaded_tokens"] = 0
        if handoff:
            params["stored_tokens"] = held
        params.update(_as_params(figures))
        if (handoff and "store_seconds" not in params) or (planned_load and "load_seconds" not in params):
            # This request's last step moved KV whose figures come with that step's worker output.
            self._open_params[request_id] = params
            while len(self._open_params) > OPEN_PARAMS_KEPT:
                self._open_params.pop(next(iter(self._open_params)))
        return False, params

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.kv_cache_events:
            self._events.extend(connector_output.kv_cache_events.get_all_events())
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, CacheLayerWorkerMetadata):
            for request_id, figures in meta.transfers.items():
                if "loaded_tokens" in figures:
                    self.planner.load_result(request_id, int(figures["loaded_tokens"]))
                params = self._open_params.get(request_id)
                if params is not None:
                    params.update(_as_params(figures))
                elif self.planner.tracks(request_id):
                    self._transfers.setdefault(request_id, {}).update(figures)
        # The step whose output this is has been answered: a dict left open now stays as it is.
        self._open_params.clear()

    def take_events(self):
        events, self._events = self._events, []
        yield from events

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.SCHEDULER:
            self.lookup_client.close()
        else:
            self._shutdown_worker()

    # ======== worker side ========

    def _init_worker(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # parallel state not set up (a single-process engine)
            self.tp_rank = 0
        self.space = key_space(vllm_config, kv_cache_config, worker_id=self.tp_rank)
        self._vllm_config = vllm_config
        self.paged: PagedKV | None = None
        self.store: ChunkStore | None = None
        self.saver: BackgroundSaver | None = None
        self.loader: BackgroundLoader | None = None
        self.lookup_server: StoreServer | None = None
        self._failed_blocks: set[int] = set()
        # Loads of this step, from start_load_kv until wait_for_save (the forward pass between).
        self._loading: list[tuple[str, float, RequestLoad]] = []
        self._layer_positions: dict[str, int] = {}
        self._step_events: list[KVCacheEvent] = []
        # What this step loaded and handed off, per request (build_connector_worker_meta).
        self._step_transfers: dict[str, dict[str, float]] = {}
        # The remote tier's events arrive from the store's writer thread, between steps.
        self._remote_events: list[KVCacheEvent] = []
        self._remote_events_lock = threading.Lock()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_index)
        self._layer_positions = {name: position for position, name in enumerate(names)}
        # All layers may be views of one storage; each name is one attention layer.
        layers = [kv_caches[name] for name in names]
        space = self.space
        if len(layers) != space.num_layers:
            raise ValueError(
                f"cachelayer: vLLM registered {len(layers)} KV layers, but the key space says "
                f"{space.num_layers}: hybrid or multi-group KV caches are not supported"
            )
        layout = detect_layout(
            layers[0], num_kv_heads=space.num_kv_heads, head_dim=space.head_dim, block_size=self.block_size
        )
        if str(layers[0].dtype).removeprefix("torch.") != space.dtype:
            raise ValueError(
                f"cachelayer: KV tensors are {layers[0].dtype}, the key space says {space.dtype}"
            )
        self.paged = PagedKV(
            layers,
            layout=layout,
            block_size=self.block_size,
            num_kv_heads=space.num_kv_heads,
            head_dim=space.head_dim,
        )
        if self.server_endpoint:
            client = StoreClient(
                self.server_endpoint,
                chunk_size=self.chunk_size,
                timeout_s=self.lookup_timeout_s,
                register_with_cuda=layers[0].is_cuda,
                secret=self.server_secret,
                # The daemon's remote-tier writes for this engine's stores, and their losses (rank
                # 0 reports, as for every medium).
                remote_feed=self.tp_rank == 0,
            )
            self.store = RemoteChunkStore(client, space)
            where = self.server_endpoint
        else:
            # The in-process store, served to this engine's scheduler side for its lookups.
            # The worker's engine honours the whole config (controller registration, own publisher).
            self.lookup_server = StoreServer(
                self.config,
                in_process_endpoint(self._vllm_config),
                start_controller_worker=True,
            )
            engine = self.lookup_server.engine_for(space)
            assert engine is not None
            if engine.remote is not None and self.tp_rank == 0:
                engine.add_event_listener(self._collect_remote_events)
            self.lookup_server.start()
            self.store = LocalChunkStore(engine)
            where = f"in-process, lookups served on {self.lookup_server.endpoint}"
        self.saver = BackgroundSaver(self.paged, self.store)
        if self.async_load:
            self.loader = BackgroundLoader(self.paged, self.store)
        log.info(
            "cachelayer connector (worker %d): layout %s, %d layers, store %s, %s loads",
            self.tp_rank,
            layout,
            len(layers),
            where,
            "asynchronous" if self.async_load else "layer-by-layer" if self.layerwise else "synchronous",
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads. Layer by layer (`use_layerwise`), each layer lands when its
        attention asks (wait_for_layer_load) and the chunks stay leased until wait_for_save;
        asynchronous (`async_load`), each load is handed to the background loader and reported
        by get_finished; else every load completes here, before the forward pass."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, CacheLayerConnectorMetadata)
        if not metadata.plan.loads or self.paged is None or self.store is None:
            return
        for load in metadata.plan.loads:
            started = time.perf_counter()
            if self.loader is not None:
                self.loader.submit(
                    request_id=load.request_id,
                    token_ids=load.token_ids,
                    block_ids=load.block_ids,
                    first_block=load.first_block,
                    cache_salt=load.cache_salt,
                )
                continue
            request_load = RequestLoad.of(self.paged, self.store, load, layerwise=self.layerwise)
            if self.layerwise:
                self._loading.append((load.request_id, started, request_load))
                failed: set[int] = set()
            else:
                failed = request_load.finish()
                self._failed_blocks |= failed
                self._step_transfers.setdefault(load.request_id, {}).update(
                    loaded_tokens=request_load.loaded_tokens(failed),
                    load_seconds=time.perf_counter() - started,
                )
            self.timings.record(
                "start_load_kv",
                started,
                request_id=load.request_id,
                tokens=len(load.token_ids),
                failed=len(failed),
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loading:
            return
        position = self._layer_positions.get(layer_name)
        if position is None:  # a layer this connector did not register: load everything now
            self._finish_loads(layers_awaited=False)
            return
        for _, _, request_load in self._loading:
            request_load.load_layer(position)

    def _finish_loads(self, *, layers_awaited: bool = True) -> None:
        """End this step's layer-by-layer loads: the rest of each load lands, its chunks are let
        go, and blocks that could not be loaded are reported. `layers_awaited`: called after the
        forward pass, so a layer that lands only now was read before it held the KV."""
        loading, self._loading = self._loading, []
        for request_id, started, request_load in loading:
            failed = request_load.finish(layers_awaited=layers_awaited)
            self._failed_blocks |= failed
            self._step_transfers.setdefault(request_id, {}).update(
                loaded_tokens=request_load.loaded_tokens(failed), load_seconds=time.perf_counter() - started
            )
            self.timings.record("layerwise_load", started, request_id=request_id, failed=len(failed))
            if request_load.late_layers and self.layerwise:
                # The engine did not ask for every layer before reading it (an attention backend
                # without vLLM's per-layer hook): load whole requests before the forward from now on.
                log.warning("cachelayer: layer-by-layer loading turned off for this engine")
                self.layerwise = False

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # Saves run once per step in wait_for_save, from the registered caches, all layers at once.
        return

    def wait_for_save(self) -> None:
        """Copy each prompt saved this step out of the paged cache; the background saver stores it
        (the step, and so the request's first token, does not wait for the store)."""
        self._finish_loads()  # layer-by-layer loads end with the forward pass
        if not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, CacheLayerConnectorMetadata)
        if not metadata.plan.saves or self.saver is None:
            return
        for save in metadata.plan.saves:
            started = time.perf_counter()
            if save.handoff:
                self._hand_off(save)
                continue
            self.saver.submit(
                request_id=save.request_id,
                token_ids=save.token_ids,
                block_ids=save.block_ids,
                cache_salt=save.cache_salt,
            )
            self.timings.record(
                "wait_for_save", started, request_id=save.request_id, tokens=len(save.token_ids)
            )

    def _hand_off(self, save: Any) -> None:
        """Store a handoff's prompt before this step returns: vLLM sends the step's sampled tokens
        (the prefill's one token, and so its answer) only after wait_for_save has returned."""
        assert self.paged is not None and self.store is not None
        completed = store_now(
            self.paged,
            self.store,
            request_id=save.request_id,
            token_ids=save.token_ids,
            block_ids=save.block_ids,
            cache_salt=save.cache_salt,
            flush_timeout_s=self.handoff_flush_s,
        )
        self._step_transfers.setdefault(save.request_id, {}).update(
            stored_tokens=completed.tokens, store_seconds=completed.seconds
        )
        if self.tp_rank == 0:
            self._step_events.extend(to_vllm_events(completed.events, completed.cache_salt, self._medium()))
        self.timings.record_seconds(
            "handoff_save", completed.seconds, request_id=save.request_id, tokens=completed.tokens
        )

    def _medium(self) -> str:
        # The daemon's chunks are every attached engine's, not this engine's CPU tier.
        return SHARED_DAEMON_MEDIUM if self.server_endpoint else EVENT_MEDIUM

    def build_connector_worker_meta(self) -> CacheLayerWorkerMetadata | None:
        if not self._step_transfers:
            return None
        transfers, self._step_transfers = self._step_transfers, {}
        return CacheLayerWorkerMetadata(transfers)

    def _collect_completed_saves(self) -> None:
        if self.saver is None:
            return
        medium = self._medium()
        for completed in self.saver.take_completed():
            if self.tp_rank == 0:
                self._step_events.extend(to_vllm_events(completed.events, completed.cache_salt, medium))
            self.timings.record_seconds(
                "background_save", completed.seconds, request_id=completed.request_id, tokens=completed.tokens
            )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The asynchronous loads finished since the last step, as vLLM's finished receives; a
        load that failed (some or all blocks) is reported finished too, and its blocks by
        get_block_ids_with_load_errors in the same step, so vLLM recomputes them. A request
        aborted while loading is reported as well: vLLM frees its blocks only then."""
        if self.loader is None:
            return None, None
        idle = self.has_connector_metadata() and getattr(self._get_connector_metadata(), "idle", False)
        completed = self.loader.take_completed(ASYNC_IDLE_WAIT_S if idle else 0.0)
        if not completed:
            return None, None
        for load in completed:
            self._failed_blocks |= load.failed_blocks
            self._step_transfers.setdefault(load.request_id, {}).update(
                loaded_tokens=load.loaded_tokens, load_seconds=load.seconds
            )
            self.timings.record_seconds(
                "async_load", load.seconds, request_id=load.request_id, failed=len(load.failed_blocks)
            )
        return None, {load.request_id for load in completed}

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def _collect_remote_events(self, events: list[Any]) -> None:
        converted = remote_tier_events(events)
        if converted:
            with self._remote_events_lock:
                self._remote_events.extend(converted)

    def get_kv_connector_kv_cache_events(self) -> CacheLayerKVEvents | None:
        self._collect_completed_saves()
        with self._remote_events_lock:
            remote, self._remote_events = self._remote_events, []
        restarted = isinstance(self.store, RemoteChunkStore) and self.store.client.take_restarts()
        if restarted and self.tp_rank == 0:  # the daemon's store is empty: so is this engine's SHARED
            self._step_events.insert(0, MediumCleared(medium=SHARED_DAEMON_MEDIUM))
        if isinstance(self.store, RemoteChunkStore):
            # After the daemon's L1 events: a chunk is stored in L1 before it is written through.
            remote = remote_feed_events(self.store.client.take_remote_feed())
        if not self._step_events and not remote:
            return None
        events, self._step_events = self._step_events + remote, []
        return CacheLayerKVEvents(events)

    def _shutdown_worker(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None
        if self.saver is not None:
            self.saver.close()
            self.saver = None
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        if isinstance(self.store, RemoteChunkStore):
            self.store.client.close()


def _as_params(figures: dict[str, float]) -> dict[str, Any]:
    """Worker figures as kv_transfer_params: token counts as ints, seconds as floats."""
    return {key: (float(value) if key.endswith("_seconds") else int(value)) for key, value in figures.items()}


# Keep the name vLLM users look for next to the class (kv_connector names the class).
__all__ = ["CacheLayerConnector", "CacheLayerConnectorMetadata", "key_space"]
