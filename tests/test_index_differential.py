"""The differential test of the index's writer: the compiled implementation (router/index/_ingest.pyx
behind `IndexWriter`, reading decoded events and payload bytes through kvwire's frame reader)
against the pure-Python reference (`kvgate_testing.index_oracle.oracle_index`: the Python rules
alone), on the same generated event streams, valid and malformed, and the two statements of the
router-key math (router/index/_keys.pxd's `block_mix` in C, `keys.mix` in Python) on generated
blocks and prompts.

Both indexes are fed the same stream call by call, as the gateway's subscriber feeds its index, and
must hold the same state after it: holder masks and their extra references, tails, nodes, chains,
stats, the longest prefixes, and every lookup. A change to either implementation alone (its key
math, its shapes, its stats) makes them disagree here.
"""

from __future__ import annotations

import importlib
import random

import numpy as np
import pytest

from kvgate_testing.index_oracle import WritableIndex, oracle_index
from kvgate_testing.index_streams import StreamMaker, assert_same_lookups, decode_streams, internal_state
from kvgate_testing.wire_payloads import HASH_STYLES, mutate, payload_corpus, payload_of
from kvwire import BlockStored, KVEvent, decode_batch
from router.index import ingest
from router.index.keys import (
    ROUTER_BLOCK_TOKENS,
    Namespace,
    block_value,
    namespace_seed,
    prefix_keys,
    router_block_values,
    small_prefix_keys,
)

BACKENDS = ("a", "b")


class CompiledIndex(WritableIndex):
    """The compiled implementation, counting the events its writer handed to the Python rules
    (so a test can say the compiled writer took the shapes it is for, not the rules alone)."""

    def __init__(self) -> None:
        super().__init__()
        for backend in BACKENDS:
            self.add_backend(backend)
        # Without the compiled writer this test compares the reference with itself: fail instead.
        assert self.ingest_path == "compiled", (
            "the compiled writer is not in use: router/index/_ingest.pyx is not built (pip install -e .), "
            "or the import refused it (a stale build, or key math that differs from keys.py: see the "
            "warning `router.index.ingest` logged, and test_both_statements_of_the_key_math_agree)"
        )
        assert self.wire_ingest("a") is not None, "kvwire/_frames.pyx is not built (pip install -e .)"
        self.to_rules = 0
        rules = self.writer.rules
        general = rules.apply_general_locked

        def counted(backend: object, events: list[KVEvent]) -> None:
            self.to_rules += len(events)
            general(backend, events)

        rules.apply_general_locked = counted  # type: ignore[method-assign]


def compiled_index() -> CompiledIndex:
    return CompiledIndex()


def reference_index() -> WritableIndex:
    index = oracle_index()
    for backend in BACKENDS:
        index.add_backend(backend)
    return index


def assert_same(
    compiled: CompiledIndex, oracle: WritableIndex, makers: dict[str, StreamMaker], where: str
) -> None:
    for backend in BACKENDS:
        assert internal_state(compiled, backend) == internal_state(oracle, backend), where
    for maker in makers.values():
        assert_same_lookups(oracle, [compiled], maker.docs)


def wire_feed(index: WritableIndex, backend: str, payloads: list[bytes]) -> None:
    """`payloads` as the subscriber hands them over in one drain: raw, to the writer's
    `apply_payloads`, which applies each one the scan accepts undecoded and decodes the rest (a
    payload the decoder refuses too is dropped, as the subscriber drops it)."""
    index.apply_payloads(backend, payloads)


def oracle_feed(index: WritableIndex, backend: str, payloads: list[bytes]) -> None:
    for payload in payloads:
        try:
            events = decode_batch(payload).events
        except Exception:  # dropped, as above
            continue
        index.apply(backend, events)


@pytest.mark.parametrize("seed", range(3))
def test_decoded_event_streams_build_the_same_index_in_both_implementations(seed: int) -> None:
    """Calls of `apply` as the subscriber makes them (lone decode events, decode steps, drained
    bursts, prefills, removals, re-stores, clears and the shapes the compiled writer must refuse),
    one stream per backend, interleaved, with snapshots replacing a backend now and then."""
    rand = random.Random(seed)
    makers = {backend: StreamMaker(4200 + 10 * seed + number) for number, backend in enumerate(BACKENDS)}
    streams = {backend: decode_streams(maker, 200) for backend, maker in makers.items()}
    compiled, oracle = compiled_index(), reference_index()
    applied: dict[str, list[KVEvent]] = {backend: [] for backend in BACKENDS}
    total = call = 0
    while streams:
        backend = rand.choice(sorted(streams))
        events = next(streams[backend], None)
        if events is None:
            del streams[backend]
            continue
        call += 1
        total += len(events)
        compiled.apply(backend, events)
        oracle.apply(backend, events)
        applied[backend] += events
        if rand.random() < 0.02:  # a snapshot: what the engine holds now, replacing the backend
            snapshot = [event for event in applied[backend][-200:] if isinstance(event, BlockStored)]
            compiled.replace_backend(backend, snapshot)
            oracle.replace_backend(backend, snapshot)
        if call % 25 == 0:
            assert_same(compiled, oracle, makers, f"seed {seed}, call {call}")
    assert_same(compiled, oracle, makers, f"seed {seed}, the end")
    # The compiled writer took its shapes (these streams are hazard-heavy: a share of them), the
    # rules the rest.
    assert total - compiled.to_rules > total // 10, (compiled.to_rules, total)


@pytest.mark.parametrize("seed", range(2))
def test_payload_streams_valid_and_malformed_build_the_same_index_in_both_implementations(seed: int) -> None:
    """The same streams as payloads of every encoding and hash style, read from the bytes by the
    compiled writer (kvwire's frame reader) and decoded for the reference, with malformed payloads
    mixed in (`wire_payloads.mutate`: bytes set, flipped, cut, inserted, spliced): each is refused
    by both, or decoded and applied by both, to the same index."""
    rand = random.Random(seed)
    makers = {backend: StreamMaker(5200 + 10 * seed + number) for number, backend in enumerate(BACKENDS)}
    corpora = {backend: payload_corpus(rand, maker, 150) for backend, maker in makers.items()}
    compiled, oracle = compiled_index(), reference_index()
    streams: dict[str, list[bytes]] = {}
    for backend, corpus in corpora.items():
        stream = streams[backend] = []
        for payload in corpus:
            stream.append(payload)
            if rand.random() < 0.3:
                stream.append(mutate(rand, rand.choice(corpus), corpus))
    events = sum(len(decode_batch(payload).events) for corpus in corpora.values() for payload in corpus)
    fed = 0
    while streams:
        backend = rand.choice(sorted(streams))
        stream = streams[backend]
        drained = stream[: rand.choice([1, 1, 2, 5, 12])]
        streams[backend] = stream[len(drained) :]
        if not streams[backend]:
            del streams[backend]
        wire_feed(compiled, backend, drained)
        oracle_feed(oracle, backend, drained)
        fed += len(drained)
        if fed % 40 < len(drained):
            assert_same(compiled, oracle, makers, f"seed {seed}, payload {fed}")
    assert_same(compiled, oracle, makers, f"seed {seed}, the end")
    assert events - compiled.to_rules > events // 10, (compiled.to_rules, events)


def test_lone_one_block_payloads_of_every_hash_style_build_the_same_index() -> None:
    """The engines' commonest message, one decode step of one request, read from the bytes: every
    hash style, the decode-shape events the compiled writer reads in place."""
    rand = random.Random(7)
    compiled, oracle = compiled_index(), reference_index()
    maker = StreamMaker(77)
    for style in HASH_STYLES:
        chain = maker.new_chain()
        chain.update(block_size=16, overlap=False, group=None, medium="GPU", doc=0)
        for _ in range(30):
            event = maker.store(chain, 1)
            if event is None:
                break
            payload = payload_of([event], rand, style)
            wire_feed(compiled, "a", [payload])
            oracle_feed(oracle, "a", [payload])
    assert_same(compiled, oracle, {"a": maker}, "lone payloads")
    assert compiled.to_rules <= len(HASH_STYLES)  # each chain's root; its children in place


def test_both_statements_of_the_key_math_agree() -> None:
    """The compiled module's key math (`block_mix`, through its `block_value` and `prompt_keys`)
    and the Python one (`keys.mix`, through the int path `block_value` and the numpy path
    `router_block_values` / `prefix_keys`) give the same values on generated blocks, positions
    and prompts, edge tokens and positions past 2**32 included. The compiled module is read as
    built, configured with keys.py's constants: a change to either statement alone fails here,
    even where the import check refused the module (then the tests above fail too)."""
    compiled = importlib.import_module("router.index._ingest")
    rand = np.random.default_rng(11)
    edges = np.array([0, 1, 2**31, 2**32 - 1], dtype=np.uint32)
    for position in [0, 1, 2, 63, 2047, 2048, 2**20 + 3, 2**32 + 5, 2**63 + 9]:
        for _ in range(40):
            tokens = rand.integers(0, 2**32, size=ROUTER_BLOCK_TOKENS, dtype=np.uint32)
            tokens[rand.random(ROUTER_BLOCK_TOKENS) < 0.3] = rand.choice(edges)
            block = tokens.tolist()
            expected = block_value(block, position)
            assert compiled.block_value(block, position) == expected, (block, position)
            assert router_block_values(tokens, position).tolist() == [expected], (block, position)
    for length in [0, 15, 16, 47, 48, 1000, 2048 * 16 + 40]:
        tokens = rand.integers(0, 2**32, size=length, dtype=np.uint32)
        for seed in (0, 2**64 - 1, namespace_seed(Namespace(cache_salt="s"))):
            for first_block in (0, 5, 2**40):
                expected = prefix_keys(tokens, seed, first_block).tolist()
                assert compiled.prompt_keys(tokens, seed, first_block) == expected, (length, first_block)
                if length <= 64:
                    assert small_prefix_keys(tokens.tolist(), seed, first_block) == expected
    # And the import took the module (it checks the same agreement on a few blocks).
    assert ingest.load_compiled_ingest() is not None
