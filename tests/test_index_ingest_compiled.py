"""The compiled ingest path (router/index/_ingest.pyx: decode steps, prefills, evictions): it is
built and used where it imports, and it builds exactly the index the pure-Python paths build, on
random decode streams with prefills, evictions and every shape outside its own mixed in."""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import random
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvgate_testing.event_publisher import block_removed, block_stored, encode_batch
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.index_streams import (
    StreamMaker,
    apply_through_general_path,
    assert_same_lookups,
    decode_streams,
    internal_state,
)
from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, decode_batch
from router.index import ingest as index_ingest
from router.index import keys as keys_module
from router.index import store as store_module
from router.index.ingest import IndexWriter
from router.index.keys import (
    FINALISER_STEPS,
    POSITION_WEIGHT_INT,
    WORD_WEIGHT_INTS,
    Namespace,
    block_value,
    namespace_seed,
    prefix_keys,
    prompt_prefix_keys,
)
from router.index.python_writer import PythonWriter
from router.index.store import NODE_FIELDS, PREVIEW_TOKENS, Chain, PrefixIndex

ingest = importlib.import_module("router.index._ingest")


class CountingWriter(ingest.BackendWriter):
    """The compiled writer, counting the events each call applied (a subclass: the index makes
    its writers from the compiled module's `BackendWriter`)."""

    applied: list[int]

    def store(self, events: list[KVEvent], start: int) -> int:
        stopped = super().store(events, start)
        CountingWriter.applied.append(stopped - start)
        return stopped


@pytest.fixture
def applied_by_compiled_path(monkeypatch) -> list[int]:
    CountingWriter.applied = []
    monkeypatch.setattr(ingest, "BackendWriter", CountingWriter)
    return CountingWriter.applied


def test_the_extension_is_built_and_applies_prefills_decode_steps_and_evictions(monkeypatch) -> None:
    """A build that failed (or a module that is not the compiled one) fails here, not silently."""
    assert ingest.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), ingest.__file__
    assert index_ingest.INGEST_PATH == "compiled"
    index = WritableIndex()
    assert index.ingest_path == "compiled"
    assert WritableIndex(compiled_ingest=False).ingest_path == "python"
    rand = random.Random(1)
    tokens = [rand.randrange(150_000) for _ in range(16 * 40)]

    def forbidden(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("an event of the compiled path's shapes went a pure-Python path")

    for name in (
        "store_one_block_locked",
        "store_decode_step_locked",
        "apply_in_runs_locked",
        "apply_general_locked",
        "remove_locked",
    ):
        monkeypatch.setattr(PythonWriter, name, forbidden)
    index.apply("a", [BlockStored(block_hashes=[1, 2], token_ids=tokens[:32], block_size=16)])  # a prefill
    index.apply(
        "a", [BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=tokens[32:48], block_size=16)]
    )
    # A drained burst: parents earlier in the same list.
    index.apply(
        "a",
        [
            BlockStored(
                block_hashes=[h],
                parent_block_hash=h - 1,
                token_ids=tokens[16 * (h - 1) : 16 * h],
                block_size=16,
            )
            for h in range(4, 41)
        ],
    )
    assert isinstance(index._backends["a"].compiled_writer, ingest.BackendWriter)
    assert index.longest_cached_prefix(tokens)["a"].tokens == 16 * 40
    stats = index.stats("a")
    assert stats is not None
    assert (stats.stored_events, stats.blocks, stats.tokens) == (39, {"gpu": 40}, {"gpu": 640})
    index.apply("a", [BlockRemoved(block_hashes=[40]), BlockRemoved(block_hashes=[39, 38])])  # evictions
    assert index.longest_cached_prefix(tokens)["a"].tokens == 16 * 37
    stats = index.stats("a")
    assert stats is not None
    assert (stats.removed_events, stats.blocks, stats.tokens) == (2, {"gpu": 37}, {"gpu": 592})


def test_the_compiled_block_value_is_the_python_one() -> None:
    rand = random.Random(2)
    edges = [0, 1, 2**31, 2**32 - 1]
    for position in [0, 1, 2, 63, 2**20, 2**40 + 7, 2**64 - 1]:
        for _ in range(30):
            block = [rand.choice([rand.randrange(2**32), rand.choice(edges)]) for _ in range(16)]
            assert ingest.block_value(block, position) == block_value(block, position)
    for bad in ([-1] * 16, [2**32] * 16, [2**70] * 16, [1.0] * 16, [1] * 15, [1] * 17, (1,) * 16, None):
        with pytest.raises((ValueError, TypeError)):
            ingest.block_value(bad, 0)


def test_the_compiled_prompt_keys_are_the_numpy_ones_and_serve_prompt_prefix_keys() -> None:
    rand = np.random.default_rng(5)
    for length in [0, 1, 15, 16, 17, 47, 48, 1000, 4096 + 9]:
        tokens = rand.integers(0, 2**32, size=length, dtype=np.uint32)
        tokens[: min(length, 4)] = [0, 2**32 - 1, 2**31, 1][: min(length, 4)]
        for seed in (0, 2**64 - 1, namespace_seed(Namespace(cache_salt="s"))):
            for first_block in (0, 3, 2**40):
                expected = prefix_keys(tokens, seed, first_block).tolist()
                assert ingest.prompt_keys(tokens, seed, first_block) == expected
    prompt = rand.integers(0, 150_000, size=1000).tolist()
    salted = Namespace(cache_salt="x")
    # The policies' entry point takes the compiled loop (registered when the package loads).
    assert keys_module._compiled_prompt_keys is ingest.prompt_keys
    assert (
        prompt_prefix_keys(prompt, salted)
        == prefix_keys(np.array(prompt, np.uint32), namespace_seed(salted)).tolist()
    )
    with pytest.raises(ValueError):  # a strided view is refused, not read wrongly
        ingest.prompt_keys(np.arange(64, dtype=np.uint32)[::2], 0)


def _python_held_runs(holders: dict[int, int], keys: list[int]) -> tuple[dict[int, int], list[int]]:
    """The pure-Python probes and runs that the compiled held_runs replaces."""
    _, masks = store_module._held_masks(holders, keys)
    return PrefixIndex._runs_of_masks(masks), masks.tolist()


def test_the_compiled_held_runs_are_the_python_probes_and_runs() -> None:
    rand = random.Random(11)
    for case in range(400):
        slots = rand.choice([1, 2, 3, 8, 64])
        keys = rand.sample(range(1, 10**6), rand.choice([0, 1, 2, 5, 63, 200]))
        holders: dict[int, int] = {}
        for key in keys:
            roll = rand.random()
            if roll < 0.08:
                continue  # a hole: no run goes past it
            # Masks that mostly keep a slot's bit block after block, as engines' prefixes do.
            mask = rand.getrandbits(slots) | (1 << rand.randrange(slots)) if roll < 0.3 else (2**slots - 1)
            holders[key] = mask
        holders.update({rand.randrange(10**7, 10**8): 1 for _ in range(5)})  # others' keys
        runs, masks = ingest.held_runs(holders, keys)
        assert (runs, masks) == _python_held_runs(holders, keys), case
        assert all(a is b for a, b in zip(masks, map(holders.get, keys), strict=False))
    assert ingest.held_runs({}, []) == ({}, [])
    assert ingest.held_runs({5: 3}, [6, 5]) == ({}, [])  # the first block is nobody's
    with pytest.raises(OverflowError):  # more than 64 slots: the caller takes the wide path
        ingest.held_runs({1: 2**64, 2: 1}, [1, 2])
    # The index's lookups with keys take it (registered when the package loads).
    assert store_module._compiled_held_runs is ingest.held_runs


@pytest.mark.parametrize("seed", range(3))
def test_lookups_given_keys_answer_as_lookups_that_compute_them(seed: int, monkeypatch) -> None:
    """Across tiers, holes, tails and namespaces: the compiled probes, the Python ones and the
    lookup that computes its own keys (numpy spans) give the same matches."""
    index = WritableIndex()
    maker = StreamMaker(500 + seed)
    held = several_tiers = 0
    for call, events in enumerate(decode_streams(maker, 120)):
        index.apply("abc"[call % 3], events)
        if call % 20 != 19:
            continue
        for doc in maker.docs:
            for namespace in (Namespace(), Namespace(lora_name="lora-a"), Namespace(cache_salt="salt-1")):
                expected = index.longest_cached_prefix(doc, namespace)
                keys = prompt_prefix_keys(doc, namespace)
                assert index.longest_cached_prefix(doc, namespace, keys=keys) == expected
                with monkeypatch.context() as python_only:
                    python_only.setattr(store_module, "_compiled_held_runs", None)
                    assert index.longest_cached_prefix(doc, namespace, keys=keys) == expected
                held += sum(1 for match in expected.values() if match.tokens)
                several_tiers += sum(1 for match in expected.values() if len(match.cumulative) > 1)
    assert held > 50 and several_tiers > 5, "too little held for the comparison to mean anything"


def test_a_mismatched_configuration_is_refused_and_leaves_the_module_working() -> None:
    weights = list(WORD_WEIGHT_INTS)
    constants = (POSITION_WEIGHT_INT, FINALISER_STEPS)
    preview = {"preview_tokens": PREVIEW_TOKENS, "capacity_field": "max_blocks", "namespace_class": Namespace}
    with pytest.raises(ValueError, match="node tuples"):
        ingest.configure(weights, *constants, 16, ("end", "keys"), BlockStored, Chain, **preview)
    with pytest.raises(ValueError, match="router blocks"):
        ingest.configure(weights, *constants, 32, NODE_FIELDS, BlockStored, Chain, **preview)
    for steps in (FINALISER_STEPS[:4], (64, *FINALISER_STEPS[1:])):  # a shift of 64 is undefined in C
        with pytest.raises(ValueError, match="finaliser"):
            ingest.configure(
                weights, POSITION_WEIGHT_INT, steps, 16, NODE_FIELDS, BlockStored, Chain, **preview
            )
    block = list(range(16))
    assert ingest.block_value(block, 3) == block_value(block, 3)


def test_without_the_extension_the_index_falls_back_to_pure_python(monkeypatch, caplog) -> None:
    monkeypatch.setitem(sys.modules, "router.index._ingest", None)  # what a failed build leaves
    with caplog.at_level(logging.DEBUG, logger="router.index.ingest"):
        assert index_ingest.load_compiled_ingest() is None
    assert "not built" in caplog.text
    monkeypatch.setattr(index_ingest, "_compiled_ingest", None)
    index = WritableIndex()
    assert index.ingest_path == "python"
    tokens = list(range(48))
    index.apply("a", [BlockStored(block_hashes=[1, 2], token_ids=tokens[:32], block_size=16)])
    index.apply(
        "a", [BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=tokens[32:], block_size=16)]
    )
    assert index._backends["a"].compiled_writer is None
    assert index.longest_cached_prefix(tokens)["a"].tokens == 48


def test_a_stale_build_is_refused_with_a_warning_not_a_crash(monkeypatch, caplog) -> None:
    """A build from an older `_ingest.pyx` (the source was updated, `pip install -e .` not run
    again): a `configure` of another signature, or a function the index needs missing. The
    index warns, names the rebuild, and applies events in pure Python."""
    import types

    def old_configure(word_weights, position_weight, finaliser_steps, block_tokens, node_layout,
                      block_stored_class, chain_class):  # fmt: skip
        raise AssertionError("not reached: the call itself is refused")

    names = {name: getattr(ingest, name) for name in index_ingest._COMPILED_INGEST_NAMES}
    stale_signature = types.SimpleNamespace(**names)
    stale_signature.configure = lambda *args, **kwargs: old_configure(*args, **kwargs)
    without_a_function = types.SimpleNamespace(**{k: v for k, v in names.items() if k != "CompiledEntry"})
    for stale, says in ((stale_signature, "block_removed_class"), (without_a_function, "no CompiledEntry")):
        monkeypatch.setitem(sys.modules, "router.index._ingest", stale)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="router.index.ingest"):
            assert index_ingest.load_compiled_ingest() is None
        assert says in caplog.text and "pip install -e ." in caplog.text


@pytest.mark.parametrize("seed", range(8))
def test_compiled_python_and_general_paths_build_the_same_index(seed: int, applied_by_compiled_path) -> None:
    compiled, python, general = WritableIndex(), WritableIndex(compiled_ingest=False), WritableIndex()
    assert compiled.ingest_path == "compiled"
    maker = StreamMaker(200 + seed)
    for call, events in enumerate(decode_streams(maker, 160)):
        compiled.apply("a", events)
        python.apply("a", events)
        apply_through_general_path(general, "a", events)
        if call % 40 == 39:
            reference = internal_state(general, "a")
            assert internal_state(compiled, "a") == reference
            assert internal_state(python, "a") == reference
    assert_same_lookups(general, [compiled, python], maker.docs)
    assert compiled.writer.compiled_applied > 0, "lone one-block events did not take the compiled entry"
    assert sum(applied_by_compiled_path) > 300, "the compiled path applied (almost) nothing"
    assert 0 in applied_by_compiled_path, "the compiled path refused nothing: the hazards did not reach it"


def test_removals_take_the_compiled_path_and_leave_the_index_the_python_paths_leave(monkeypatch) -> None:
    """Evictions one block an event (as vLLM announces them), alone and in batches with decode
    steps; a block held in two tiers losing one; a multi-block removal with an unknown hash; a
    prefix stored twice in a tier (an extra reference: the Python path's). Removals of a prefix
    with a second reference go the Python path, every other the compiled path, and the index
    equals the pure-Python one's throughout."""
    rand = random.Random(9)
    tokens = [rand.randrange(150_000) for _ in range(16 * 30)]
    chain = lone_chain(tokens, 1, 30)
    compiled, python = WritableIndex(), WritableIndex(compiled_ingest=False)
    removals_in_python: list[BlockRemoved] = []  # by the compiled index's Python path
    original = PythonWriter.remove_locked

    def spy(self: PythonWriter, backend: Any, event: BlockRemoved) -> None:
        if self.index is compiled:
            removals_in_python.append(event)
        original(self, backend, event)

    monkeypatch.setattr(PythonWriter, "remove_locked", spy)

    def both(events: list[KVEvent]) -> None:
        compiled.apply("a", events)
        python.apply("a", events)
        assert internal_state(compiled, "a") == internal_state(python, "a")

    for event in chain[:20]:
        both([event])
    both([BlockStored(block_hashes=[5, 6], token_ids=[], block_size=16, medium="cpu")])  # offloaded too
    removals_in_python.clear()
    both([BlockRemoved(block_hashes=[20])])  # the newest block, alone
    both([chain[20], BlockRemoved(block_hashes=[19]), chain[21]])  # with a decode step's stores
    both([BlockRemoved(block_hashes=[5])])  # GPU copy gone, the CPU copy stays
    assert compiled.longest_cached_prefix(tokens[: 16 * 6])["a"].tokens == 16 * 6
    both([BlockRemoved(block_hashes=[6, 10**9, 7])])  # an unknown hash among them
    both([BlockRemoved(block_hashes=[6], medium="cpu")])
    assert removals_in_python == [], "a plain removal went the Python path"
    assert compiled.stats("a").unknown_removals == 1
    # The same prefix stored twice in the tier (blocks 1-2 again under new hashes): the prefix
    # has a second reference, so removing either copy is left to the Python path, which counts it.
    both([BlockStored(block_hashes=[101, 102], token_ids=tokens[:32], block_size=16)])
    both([BlockRemoved(block_hashes=[2])])
    assert len(removals_in_python) == 1
    # 102 still holds the prefix block 2 held: blocks 1-5 are still cached (5 in the CPU tier).
    assert compiled.longest_cached_prefix(tokens)["a"].tokens == 16 * 5
    for event in chain[:4]:  # after removals: every block stored again
        both([BlockRemoved(block_hashes=event.block_hashes)])
    both([BlockRemoved(block_hashes=[101, 102])])
    assert compiled.stats("a") == python.stats("a")
    assert compiled.held_tokens("a") == python.held_tokens("a")


def test_the_same_decode_stream_on_two_backends_shares_mask_objects(applied_by_compiled_path) -> None:
    """A second backend storing the prefixes the first holds: its masks are the index's shared
    objects, as the Python paths make them; lookups see both backends."""
    rand = random.Random(4)
    tokens = [rand.randrange(150_000) for _ in range(16 * 30)]
    events: list[KVEvent] = [BlockStored(block_hashes=[1], token_ids=tokens[:16], block_size=16)]
    events += [
        BlockStored(
            block_hashes=[h], parent_block_hash=h - 1, token_ids=tokens[16 * (h - 1) : 16 * h], block_size=16
        )
        for h in range(2, 31)
    ]
    compiled, python = WritableIndex(), WritableIndex(compiled_ingest=False)
    for index in (compiled, python):
        # Slots 0-9 elsewhere: a and b get bits past 256 (smaller ints are CPython singletons anyway).
        for other in range(10):
            index.apply(f"other-{other}", [BlockStored(block_hashes=[1], token_ids=[7] * 16, block_size=16)])
        for backend in ("a", "b"):
            index.apply(backend, events[:1])
            for event in events[1:]:
                index.apply(backend, [event])
    # Lone events: the compiled entry applies them. The first event of each of the 12 backends
    # goes the Python apply, which makes the backend and its writer, and the writer's `apply_one`
    # applies it (`store`, for batches of several, is never called).
    assert compiled.writer.compiled_applied == 2 * 29 and applied_by_compiled_path == []
    assert internal_state(compiled, "a") == internal_state(python, "a")
    assert internal_state(compiled, "b") == internal_state(python, "b")
    both = compiled._backends["a"].medium_slots[None][1] | compiled._backends["b"].medium_slots[None][1]
    assert both > 256
    shared = compiled.shared_masks[both]
    assert [key for key, mask in compiled.holders.items() if mask == both and mask is not shared] == []
    assert sum(mask is shared for mask in compiled.holders.values()) == 30
    # The nodes' `end` ints are shared objects too (ends past 256 are not CPython singletons).
    nodes_a, nodes_b = compiled._backends["a"].nodes, compiled._backends["b"].nodes
    assert all(nodes_a[h][0] == 16 * h and nodes_a[h][0] is nodes_b[h][0] for h in range(2, 31))
    matches = compiled.longest_cached_prefix(tokens)
    assert (matches["a"].tokens, matches["b"].tokens) == (480, 480)


def test_events_outside_the_shape_are_refused_with_the_index_untouched() -> None:
    rand = random.Random(5)
    tokens = [rand.randrange(150_000) for _ in range(16 * 8)]
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=[1, 2], token_ids=tokens[:32], block_size=16)])
    index.apply("a", [BlockStored(block_hashes=[3], token_ids=tokens[:24], block_size=24)])  # a tail
    index.apply(
        "a", [BlockStored(block_hashes=[4], parent_block_hash=2, token_ids=tokens[32:48], block_size=16)]
    )
    writer = index._backends["a"].compiled_writer
    assert writer is not None

    class OtherEvent(BlockStored):
        pass

    def child(block_hash: int, parent: Any = 2, token_ids: Any = None, **fields: Any) -> BlockStored:
        chosen = tokens[48:64] if token_ids is None else token_ids
        return BlockStored(
            block_hashes=[block_hash], parent_block_hash=parent, token_ids=chosen, block_size=16, **fields
        )

    def prefill(hashes: Any = None, parent: Any = 2, token_ids: Any = None, **fields: Any) -> BlockStored:
        return BlockStored(
            block_hashes=hashes or [10, 11],
            parent_block_hash=parent,
            token_ids=tokens[48:80] if token_ids is None else token_ids,
            block_size=16,
            **fields,
        )

    refused = [
        child(4),  # already placed
        child(10, parent=3),  # the parent ends inside a router block
        child(10, parent=99),  # unknown parent
        child(10, token_ids=[-1] * 16),
        child(10, token_ids=[2**32] * 16),
        child(10, token_ids=[1.0] * 16),
        child(10, token_ids=list(np.arange(16, dtype=np.int64))),  # numpy ints: the Python paths take them
        child(10, token_ids=tuple(tokens[48:64])),
        child(10, token_ids=tokens[48:63]),
        child(10, group_idx=1),
        BlockStored(block_hashes=[10], parent_block_hash=2, token_ids=tokens[48:64]),  # no block size
        BlockStored(block_hashes=[10], parent_block_hash=2, token_ids=tokens[48:64], block_size=32),
        prefill([10, 4]),  # one hash placed already
        prefill([10, 10]),  # twice the same hash
        prefill(parent=3),  # the parent ends inside a router block
        prefill(parent=99),
        prefill(token_ids=tokens[48:79]),
        prefill(token_ids=[*tokens[48:79], -1]),
        prefill(group_idx=1),
        prefill(token_ids=tokens[32:64]),  # completes the prefix block 4 holds in this tier
        OtherEvent(block_hashes=[10], parent_block_hash=2, token_ids=tokens[48:64], block_size=16),
        child(10, parent=2, token_ids=tokens[32:48]),  # completes the prefix block 4 holds in this tier
        BlockRemoved(block_hashes=[3]),  # a block with a tail
        BlockRemoved(block_hashes=[4, 3]),  # a plain block, then one with a tail: refused whole
        BlockRemoved(block_hashes=[4], group_idx=1),
        BlockRemoved(block_hashes=[4], medium="cpu"),  # a medium the backend never stored under
        BlockRemoved(block_hashes=(4,)),  # type: ignore[arg-type]  # not a list
        AllBlocksCleared(),
    ]
    for event in refused:
        before = internal_state(index, "a")
        with index._lock:
            assert writer.store([event], 0) == 0, event
            assert not writer.apply_one(event), event
        assert internal_state(index, "a") == before, event
    # A root and a prefill continuing a placed block: applied alone in their batch (`apply_one`),
    # left to the Python path's batched pass within a batch of several (`store`).
    for event in (
        child(10, parent=None),
        BlockStored(block_hashes=[11, 12], parent_block_hash=4, token_ids=tokens[48:80], block_size=16),
    ):
        with index._lock:
            assert writer.store([event], 0) == 0, event
            assert writer.apply_one(event), event
    assert index.longest_cached_prefix(tokens)["a"].tokens == 80
    for block_hash in (10, 11, 12):
        index.apply("a", [BlockRemoved(block_hashes=[block_hash])])
    # A list: the leading events of the shape are applied, the position of the first other returned.
    events: list[KVEvent] = [
        child(10, parent=4),
        child(11, parent=10, token_ids=tokens[64:80]),
        child(12, parent=99),
    ]
    with index._lock:
        assert writer.store(events, 0) == 2
        assert writer.store(events, 2) == 2
    assert index.longest_cached_prefix(tokens)["a"].tokens == 80


def test_a_drained_burst_from_the_wire_resumes_the_compiled_path_after_other_events(
    applied_by_compiled_path,
) -> None:
    """Decoded wire batches (map-encoded events: the decoder's own subclass) joined into one
    call, prefills of 32-token blocks (the general path's) and a removal between decode steps:
    each run of decode steps (with the removal) is applied by the compiled path, the prefills by
    the general path, and the index equals the pure-Python one's."""
    rand = random.Random(6)
    docs = [[rand.randrange(150_000) for _ in range(16 * 20)] for _ in range(3)]
    wire: list[Any] = []
    next_hash = 100
    for doc_number, doc in enumerate(docs):
        first = next_hash
        wire.append(block_stored(list(range(first, first + 2)), doc[:64], 32, encoding="map"))
        next_hash += 2
        for block in range(4, 20):
            wire.append(
                block_stored(
                    [next_hash],
                    doc[16 * block : 16 * block + 16],
                    16,
                    parent_block_hash=next_hash - 1,
                    encoding="map",
                )
            )
            next_hash += 1
        if doc_number == 1:
            wire.append(block_removed([first + 2], encoding="map"))
    events = decode_batch(encode_batch(wire, encoding="array")).events
    assert type(events[1]) is not BlockStored and isinstance(events[1], BlockStored)
    compiled, python = WritableIndex(), WritableIndex(compiled_ingest=False)
    compiled.apply("a", events)
    python.apply("a", events)
    assert internal_state(compiled, "a") == internal_state(python, "a")
    # Document 1's removal is applied by the compiled path too, in the run of its decode steps.
    assert [count for count in applied_by_compiled_path if count] == [16, 17, 16]


def lone_chain(tokens: list[int], first_hash: int, blocks: int) -> list[BlockStored]:
    """One request's blocks as an engine publishes them while decoding: a root, then one event per
    filled block, each the child of the one before."""
    events = [BlockStored(block_hashes=[first_hash], token_ids=tokens[:16], block_size=16)]
    for at in range(1, blocks):
        events.append(
            BlockStored(
                block_hashes=[first_hash + at],
                parent_block_hash=first_hash + at - 1,
                token_ids=tokens[16 * at : 16 * (at + 1)],
                block_size=16,
            )
        )
    return events


def test_lone_decode_events_take_the_compiled_entry_and_every_other_batch_the_python_apply(
    monkeypatch,
) -> None:
    calls: list[int] = []
    original = IndexWriter._apply_refused

    def spy(self: IndexWriter, backend_name: str, events: list[KVEvent], first_refused: bool) -> None:
        calls.append(len(events))
        original(self, backend_name, events, first_refused)

    # (where the compiled entry hands a batch back to the Python rules)
    monkeypatch.setattr(IndexWriter, "_apply_refused", spy)
    index, general = WritableIndex(), WritableIndex()
    rand = random.Random(5)
    tokens = [rand.randrange(150_000) for _ in range(16 * 12)]
    chain = lone_chain(tokens, 1, 12)
    for event in chain[:6]:
        index.apply("a", [event])
    # The root has no parent: the Python apply takes it; its children the compiled entry.
    assert calls == [1] and index.writer.compiled_applied == 5
    index.apply("a", chain[6:8])  # two events: a batch for the Python apply
    index.apply("a", [chain[7]])  # stored already: refused, then the Python apply counts it
    index.apply("a", (chain[8],))  # not a list: the Python apply
    for event in chain[9:]:
        index.apply("a", [event])
    assert calls == [1, 2, 1, 1] and index.writer.compiled_applied == 8
    for event in [*chain[:8], chain[7], *chain[8:]]:
        apply_through_general_path(general, "a", [event])
    assert internal_state(index, "a") == internal_state(general, "a")
    assert index.longest_cached_prefix(tokens)["a"].tokens == 16 * 12


def test_stats_of_events_the_compiled_entry_applied_are_there_when_read() -> None:
    """The compiled entry leaves a lone event's stats pending in its writer: every read (stats,
    held_tokens) and every reset (a clear, a snapshot) sees them, as the Python paths' stats."""
    rand = random.Random(6)
    tokens = [rand.randrange(150_000) for _ in range(16 * 20)]
    compiled, python = WritableIndex(), WritableIndex(compiled_ingest=False)
    for index in (compiled, python):
        for event in lone_chain(tokens, 1, 20):
            index.apply("a", [event])
    assert compiled.writer.compiled_applied == 19
    assert compiled.held_tokens("a") == python.held_tokens("a") == 16 * 20
    assert compiled.stats("a") == python.stats("a")
    for index in (compiled, python):
        for event in lone_chain(tokens[::-1], 100, 5):
            index.apply("a", [event])
        index.clear_backend("a")
        for event in lone_chain(tokens, 200, 3):
            index.apply("a", [event])
    assert compiled.held_tokens("a") == python.held_tokens("a") == 16 * 3
    assert compiled.stats("a") == python.stats("a")
    assert compiled.stats("a").stored_events == 28
    for index in (compiled, python):
        index.replace_backend("a", lone_chain(tokens, 300, 2))
    assert compiled.stats("a") == python.stats("a")
    assert (compiled.stats("a").stored_events, compiled.held_tokens("a")) == (30, 32)


def test_the_writer_lock_excludes_writers_and_lets_its_holder_finish() -> None:
    index = WritableIndex()
    lock = index._lock
    assert isinstance(lock, ingest.WriterLock)
    rand = random.Random(7)
    tokens = [rand.randrange(150_000) for _ in range(16 * 3)]
    chain = lone_chain(tokens, 1, 3)
    index.apply("a", chain[:2])
    applied = threading.Event()

    def writer() -> None:
        index.apply("a", [chain[2]])  # the compiled entry: it must wait for the lock
        applied.set()

    with lock:
        assert lock.locked() and lock.acquire(blocking=False) is False
        thread = threading.Thread(target=writer)
        thread.start()
        # The writer waits without the GIL: this thread runs on while it waits.
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            assert not applied.is_set(), "a writer went through while the lock was held"
            time.sleep(0.01)
        assert index.longest_cached_prefix(tokens)["a"].tokens == 32
    thread.join(5)
    assert applied.is_set() and not lock.locked()
    assert index.longest_cached_prefix(tokens)["a"].tokens == 48
    with pytest.raises(RuntimeError, match="unheld"):
        lock.release()


def test_writers_of_several_backends_at_once_build_the_index_one_writer_builds() -> None:
    """One subscriber thread per backend: lone events of four backends applied concurrently (the
    same documents, so the backends share prefixes and mask objects) equal one thread's result."""
    rand = random.Random(8)
    docs = [[rand.randrange(150_000) for _ in range(16 * 40)] for _ in range(3)]
    streams = {
        f"b{n}": [event for d, doc in enumerate(docs) for event in lone_chain(doc, 1000 * d + 1, 40)]
        for n in range(4)
    }
    concurrent, sequential = WritableIndex(), WritableIndex()
    for index in (concurrent, sequential):  # each backend's first event, in turn: the same slots
        for name, events in streams.items():
            index.apply(name, events[:1])
    for name, events in streams.items():
        for event in events[1:]:
            sequential.apply(name, [event])
    start = threading.Barrier(len(streams))

    def feed(name: str, events: list[BlockStored]) -> None:
        start.wait()
        for event in events[1:]:
            concurrent.apply(name, [event])

    threads = [threading.Thread(target=feed, args=item) for item in streams.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # Every event after each backend's first, the roots of documents 2 and 3 included.
    assert concurrent.writer.compiled_applied == sequential.writer.compiled_applied == 4 * (3 * 40 - 1)
    for name in streams:
        assert internal_state(concurrent, name) == internal_state(sequential, name)
    assert_same_lookups(sequential, [concurrent], docs)


def test_an_event_the_compiled_entry_refused_is_not_offered_to_the_compiled_writer_again(monkeypatch) -> None:
    """The compiled entry tells the Python writer which event it refused, and the Python writer
    applies that one by the general path: the compiled writer sees no event twice, alone or from
    the wire (events do not go back and forth between the two writers)."""
    offered: list[tuple[str, Any]] = []

    class RecordingWriter(ingest.BackendWriter):
        """The compiled writer, recording what its Python-visible entries are offered."""

        def apply_one(self, event: KVEvent) -> bool:
            offered.append(("apply_one", tuple(event.block_hashes)))
            return super().apply_one(event)

        def store(self, events: list[KVEvent], start: int) -> int:
            if start < len(events):
                offered.append(("store", tuple(events[start].block_hashes)))
            return super().store(events, start)

        def store_wire(self, batch: Any, start: int = 0) -> int:
            offered.append(("store_wire", start))
            return super().store_wire(batch, start)

    monkeypatch.setattr(ingest, "BackendWriter", RecordingWriter)
    rand = random.Random(8)
    tokens = [rand.randrange(150_000) for _ in range(16 * 10)]
    chain = lone_chain(tokens, 1, 10)
    index, python = WritableIndex(), WritableIndex(compiled_ingest=False)
    for event in chain[:6]:
        index.apply("a", [event])
        python.apply("a", [event])
    offered.clear()
    index.apply("a", [chain[3]])  # stored already: the compiled entry refuses it
    python.apply("a", [chain[3]])
    assert offered == []
    wire = index.wire_ingest("a")
    assert wire is not None
    payload = encode_batch(
        [
            block_stored([7], tokens[96:112], 16, parent_block_hash=6),
            block_stored([4], tokens[48:64], 16, parent_block_hash=3),  # stored already: refused
            block_stored([8], tokens[112:128], 16, parent_block_hash=7),
        ]
    )
    batch = wire.scan(payload)
    assert batch is not None
    wire.apply([batch])
    python.apply("a", decode_batch(payload).events)
    # The entry applied the first event and refused the second; the Python writer applies that
    # one and offers the compiled writer only the third.
    assert offered == [("store", (8,))]
    assert index.writer.compiled_applied == 5  # chain[1:6] alone; the refused wire batch went on to Python
    assert internal_state(index, "a") == internal_state(python, "a")
