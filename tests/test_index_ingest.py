"""Ingest fast paths: whole-batch event application and whole-batch decoding give exactly what the
event-by-event paths give, on random streams with every shape the index accepts."""

from __future__ import annotations

import contextlib
import random
from typing import Any

import msgspec
import pytest

from kvgate_testing.event_publisher import all_blocks_cleared, block_removed, block_stored, encode_batch
from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.index_streams import (
    DOC_TOKENS,
    StreamMaker,
    apply_through_general_path,
    assert_same_lookups,
    internal_state,
    make_docs,
)
from kvwire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    decode_batch,
    decode_event,
)
from router.index.python_writer import PythonWriter


def record_decode_step_path(monkeypatch) -> list[bool]:
    """Whether each call of the decode-step path took the events (True) or refused them."""
    taken: list[bool] = []
    original = PythonWriter.store_decode_step_locked

    def spy(self, backend, events):
        took = original(self, backend, events)
        taken.append(took)
        return took

    monkeypatch.setattr(PythonWriter, "store_decode_step_locked", spy)
    return taken


# Both ingest paths: the compiled one-block path where it is built, and the pure-Python fallback.
BOTH_PATHS = pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])


@BOTH_PATHS
@pytest.mark.parametrize("seed", range(12))
def test_batched_one_by_one_and_general_paths_build_the_same_index(seed: int, compiled: bool) -> None:
    maker = StreamMaker(seed)
    batched = WritableIndex(compiled_ingest=compiled)
    one_by_one, general = WritableIndex(compiled_ingest=compiled), WritableIndex()
    for step in range(60):
        batch = maker.batch()
        batched.apply("a", batch)
        for event in batch:
            one_by_one.apply("a", [event])
        apply_through_general_path(general, "a", batch)
        if step % 10 == 9 or step == 59:
            reference = internal_state(general, "a")
            assert internal_state(batched, "a") == reference
            assert internal_state(one_by_one, "a") == reference
            assert_same_lookups(general, [batched, one_by_one], maker.docs)


@pytest.mark.parametrize("seed", range(6))
def test_long_mixed_lists_applied_run_by_run_match_the_general_path(seed: int, monkeypatch) -> None:
    """What a drained burst or a replay hands over: many batches' events in one call, decode-step
    runs between prefills, removals, re-stores and clears (the pure-Python paths; the compiled
    path's equivalent is in test_index_ingest_compiled.py)."""
    taken = record_decode_step_path(monkeypatch)
    maker = StreamMaker(100 + seed)

    def start_requests() -> list[dict[str, Any]]:  # requests decoding their own tokens
        chains = [maker.new_chain() for _ in range(4)]
        for chain in chains:
            maker.docs.append([maker.rand.randrange(150_000) for _ in range(DOC_TOKENS)])
            chain.update(block_size=16, overlap=False, group=None, medium="GPU", doc=len(maker.docs) - 1)
        return chains

    decoding = start_requests()
    joined, general = WritableIndex(compiled_ingest=False), WritableIndex()
    for _ in range(12):
        events: list[KVEvent] = []
        for _ in range(maker.rand.randint(2, 8)):
            batch = maker.batch()
            events += batch
            if any(isinstance(event, AllBlocksCleared) for event in batch):
                decoding = start_requests()  # the engine dropped everything: new requests
            for _ in range(maker.rand.randint(1, 4)):  # decode steps of the running requests
                events += [event for chain in decoding if (event := maker.store(chain, 1)) is not None]
        joined.apply("a", events)
        apply_through_general_path(general, "a", events)
        assert internal_state(joined, "a") == internal_state(general, "a")
    for doc in maker.docs:
        assert joined.longest_cached_prefix(doc) == general.longest_cached_prefix(doc)
    assert taken.count(True) >= 3, "no decode-step run took the column path"


@BOTH_PATHS
def test_decode_steps_of_many_requests_in_one_batch_match_the_general_path(compiled: bool) -> None:
    """The decode shape (one 16-token block per request per step), many steps, then removals."""
    maker = StreamMaker(99)
    chains = [maker.new_chain() for _ in range(6)]
    for chain in chains:
        chain.update(block_size=16, overlap=False, group=None)
    batched, general = WritableIndex(compiled_ingest=compiled), WritableIndex()
    for _ in range(30):
        batch: list[KVEvent] = [event for chain in chains if (event := maker.store(chain, 1)) is not None]
        batched.apply("a", batch)
        apply_through_general_path(general, "a", batch)
    removal = [BlockRemoved(block_hashes=[h for h, _, _ in maker.known[::3]], medium=chains[0]["medium"])]
    batched.apply("a", removal)
    apply_through_general_path(general, "a", removal)
    assert internal_state(batched, "a") == internal_state(general, "a")


@pytest.mark.parametrize("running", [1, 2, 3, 32])
def test_decode_steps_take_the_column_path_and_match_the_general_path(running: int, monkeypatch) -> None:
    """Decode steps of one medium (the shape `store_decode_step_locked` and, for one request,
    `store_one_block_locked` take): every step after the first is applied by them, and the index
    equals the general path's, also when removals come in between and another backend holds the
    same prefixes."""
    maker = StreamMaker(7)
    chains = [maker.new_chain() for _ in range(running)]
    for chain in chains:  # a document of its own each (requests sharing a prefix share blocks)
        maker.docs.append([maker.rand.randrange(150_000) for _ in range(DOC_TOKENS)])
        chain.update(block_size=16, overlap=False, group=None, medium="GPU", doc=len(maker.docs) - 1)
    taken = []
    for name in ("store_decode_step_locked", "store_one_block_locked"):
        original = getattr(PythonWriter, name)

        def spy(self, backend, events, original=original):
            took = original(self, backend, events)
            taken.append(took)
            return took

        monkeypatch.setattr(PythonWriter, name, spy)
    fast, general = WritableIndex(compiled_ingest=False), WritableIndex()
    for step in range(40):
        batch: list[KVEvent] = [event for chain in chains if (event := maker.store(chain, 1)) is not None]
        if step == 20:  # the fast path must leave these to the general path
            batch.append(BlockRemoved(block_hashes=[h for h, _, _ in maker.known[::5]], medium="GPU"))
        taken.clear()
        for backend in ("a", "b"):  # "b" stores prefixes "a" holds: their masks gain b's slot
            fast.apply(backend, batch)
            apply_through_general_path(general, backend, batch)
        if 0 < step < 20:
            assert taken == [True, True], f"step {step} went the general way"
    assert internal_state(fast, "a") == internal_state(general, "a")
    assert internal_state(fast, "b") == internal_state(general, "b")
    for doc in maker.docs:
        assert fast.longest_cached_prefix(doc) == general.longest_cached_prefix(doc)


@pytest.mark.parametrize(("running", "steps_per_call"), [(1, 2), (1, 16), (2, 3), (3, 16), (8, 5)])
def test_several_decode_steps_in_one_list_take_the_column_path(
    running: int, steps_per_call: int, monkeypatch
) -> None:
    """A drained burst of decode steps in one call (parents earlier in the same list, one chain or
    several interleaved) is applied by `store_decode_step_locked` and equals the general path."""
    maker = StreamMaker(11)
    chains = [maker.new_chain() for _ in range(running)]
    for chain in chains:
        maker.docs.append([maker.rand.randrange(150_000) for _ in range(DOC_TOKENS)])
        chain.update(block_size=16, overlap=False, group=None, medium="GPU", doc=len(maker.docs) - 1)
    chains[-1]["namespace"] = {}  # (looked up below in the default namespace)
    taken = record_decode_step_path(monkeypatch)
    fast, general = WritableIndex(compiled_ingest=False), WritableIndex()
    first = [event for chain in chains if (event := maker.store(chain, 1)) is not None]
    for index in (fast, general):
        apply_through_general_path(index, "a", first)  # the chains' first blocks: roots
    for _ in range(DOC_TOKENS // 16 // steps_per_call):
        events: list[KVEvent] = [
            event for _ in range(steps_per_call) for chain in chains if (event := maker.store(chain, 1))
        ]
        taken.clear()
        fast.apply("a", events)
        apply_through_general_path(general, "a", events)
        assert taken == ([True] if len(events) > 1 else []), "the list went the general way"
    assert internal_state(fast, "a") == internal_state(general, "a")
    for doc in maker.docs:
        assert fast.longest_cached_prefix(doc) == general.longest_cached_prefix(doc)
    held = fast.longest_cached_prefix(maker.docs[-1])["a"].tokens
    assert held == chains[-1]["stored"] > 16 * steps_per_call


def test_decode_step_path_refuses_what_it_cannot_apply_and_changes_nothing() -> None:
    """Shapes outside the decode step (a re-store, a parent with a tail, tokens out of uint32
    range, two media, an unknown parent) are refused with the index untouched."""
    tokens = make_docs(random.Random(5))[0]
    index = WritableIndex(compiled_ingest=False)
    index.apply("a", [BlockStored(block_hashes=[1, 2], token_ids=tokens[:32], block_size=16)])
    index.apply("a", [BlockStored(block_hashes=[3], token_ids=tokens[:24], block_size=24)])  # tail

    def step(*events: BlockStored) -> bool:
        before = internal_state(index, "a")
        backend = index._backends["a"]
        with index._lock:
            took = (
                index.writer.rules.store_one_block_locked(backend, events[0])
                if len(events) == 1
                else index.writer.rules.store_decode_step_locked(backend, list(events))
            )
        if not took:
            assert internal_state(index, "a") == before
        return took

    def child(block_hash: int, parent: int, token_ids: list[int] | None = None, **fields: Any) -> BlockStored:
        return BlockStored(
            block_hashes=[block_hash],
            parent_block_hash=parent,
            token_ids=tokens[32:48] if token_ids is None else token_ids,
            block_size=16,
            **fields,
        )

    for events in (
        [child(2, 1)],  # already placed
        [child(10, 3)],  # the parent ends inside a router block
        [child(10, 99)],  # unknown parent
        [child(10, 2, [-1] * 16)],  # not uint32
        [child(10, 2), child(11, 2, medium="cpu")],  # two media
        [child(10, 2), child(10, 2), child(12, 2)],  # one hash twice
        [child(11, 10, tokens[48:64]), child(10, 2)],  # a child listed before its parent
        [child(10, 2), child(11, 10, tokens[48:64]), child(12, 98)],  # one unknown parent
        [child(10, 2), BlockStored(block_hashes=[11], token_ids=tokens[48:64], block_size=16)],  # a root
    ):
        assert not step(*events)
    assert step(child(10, 2), child(11, 10, tokens[48:64]))  # the parent earlier in the list
    assert index.longest_cached_prefix(tokens[:80])["a"].tokens == 64


def test_a_batch_storing_one_prefix_twice_keeps_both_references() -> None:
    """Two KV-cache groups announce the same tokens in one batch: removing one keeps the prefix."""
    tokens = make_docs(random.Random(3))[0][:64]
    index = WritableIndex()
    index.apply(
        "a",
        [
            BlockStored(block_hashes=[1, 2, 3, 4], token_ids=tokens, block_size=16),
            BlockStored(block_hashes=[1, 2, 3, 4], token_ids=tokens, block_size=16, group_idx=1),
        ],
    )
    index.apply("a", [BlockRemoved(block_hashes=[1, 2, 3, 4])])
    assert index.longest_cached_prefix(tokens)["a"].tokens == 64
    index.apply("a", [BlockRemoved(block_hashes=[1, 2, 3, 4], group_idx=1)])
    assert index.longest_cached_prefix(tokens)["a"].tokens == 0


def _random_wire_batch(rand: random.Random, event_encoding: str) -> list[Any]:
    events: list[Any] = []
    for i in range(rand.randint(1, 6)):
        kind = rand.random()
        if kind < 0.7:
            events.append(
                block_stored(
                    [rand.choice([rand.getrandbits(64), -rand.getrandbits(63), rand.randbytes(32)])],
                    [rand.randrange(150_000) for _ in range(16)],
                    16,
                    parent_block_hash=rand.choice([None, i]),
                    medium=rand.choice(["GPU", "cpu", None]),
                    encoding=event_encoding,  # type: ignore[arg-type]
                )
            )
        elif kind < 0.9:
            events.append(block_removed([rand.getrandbits(64)], encoding=event_encoding))
        else:
            events.append(all_blocks_cleared(encoding=event_encoding))
    return events


@pytest.mark.parametrize("batch_encoding", ["array", "map", "sglang-map"])
def test_whole_batch_decoding_equals_event_by_event_decoding(batch_encoding: str) -> None:
    rand = random.Random(11)
    for round_ in range(40):
        # Mostly one event encoding per batch (engines keep one); sometimes both in one batch, and
        # sometimes a bad or unknown event: those batches must decode event by event.
        wire = _random_wire_batch(rand, rand.choice(["array", "map"]))
        if round_ % 5 == 3:
            wire += _random_wire_batch(rand, "map" if isinstance(wire[0], list) else "array")
        if round_ % 7 == 5:
            wire.insert(rand.randrange(len(wire) + 1), {"type": "SomethingNew", "x": 1})
        payload = encode_batch(wire, rank=2, encoding=batch_encoding, ts=1.5)  # type: ignore[arg-type]
        decoded = decode_batch(payload)
        expected = []
        for event in wire:
            with contextlib.suppress(msgspec.ValidationError):
                expected.append(decode_event(msgspec.msgpack.encode(event)))
        assert decoded.events == expected
        assert decoded.skipped_events == len(wire) - len(expected)
        assert (decoded.ts, decoded.data_parallel_rank) == (1.5, 2)
