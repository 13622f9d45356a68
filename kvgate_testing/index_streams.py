"""Random KV-event streams for the index-ingest tests, and the index states they compare:
`StreamMaker` (engine-like request chains, batch by batch), `decode_streams` (calls of `apply` as
the subscriber makes them), the general event-by-event path as the reference, and comparisons of
internal state and lookups."""

from __future__ import annotations

import random
from typing import Any

from kvwire import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from router.index.store import PrefixIndex, owned_keys

DOC_TOKENS = 640


def make_docs(rand: random.Random) -> list[list[int]]:
    """Documents sharing prefixes of various lengths (so chains meet on the same router keys)."""
    base = [rand.randrange(150_000) for _ in range(DOC_TOKENS)]
    docs = [base]
    for shared in (0, 48, 200, 333, 640):
        docs.append(base[:shared] + [rand.randrange(150_000) for _ in range(DOC_TOKENS - shared)])
    return docs


class StreamMaker:
    """Random event batches from engine-like request chains: prefills, decode steps, removals,
    clears, partial tail chunks, overlapping chunk tokens, other tiers, namespaces, KV groups."""

    def __init__(self, seed: int) -> None:
        self.rand = random.Random(seed)
        self.docs = make_docs(self.rand)
        self.next_hash = 1
        self.known: list[tuple[int, str | None, int | None]] = []  # (hash, medium, group)
        self.chains: list[dict[str, Any]] = []

    def new_chain(self) -> dict[str, Any]:
        rand = self.rand
        chain = {
            "doc": rand.randrange(len(self.docs)),
            "block_size": rand.choice([16, 16, 16, 32, 48, 8, 12, 24, 64]),
            "medium": rand.choice([None, "GPU", "GPU", "cpu", "CPU", "LocalDiskBackend"]),
            "group": rand.choice([None, None, None, 0, 1]),
            "overlap": rand.random() < 0.2,
            "namespace": rand.choice([{}, {}, {"lora_name": "lora-a"}, {"extra_keys": [["salt-1"]]}]),
            "parent": None,
            "stored": 0,
        }
        self.chains.append(chain)
        return chain

    def store(self, chain: dict[str, Any], count: int) -> BlockStored | None:
        doc = self.docs[chain["doc"]]
        size, start = chain["block_size"], chain["stored"]
        if start >= len(doc):
            return None
        covered = min(size * count, len(doc) - start)  # a short last chunk: a partial tail
        count = -(-covered // size)
        extra = 1 if chain["overlap"] and start + covered < len(doc) else 0
        hashes = list(range(self.next_hash, self.next_hash + count))
        self.next_hash += count
        first = chain["parent"] is None
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=chain["parent"],
            token_ids=doc[start : start + covered + extra],
            block_size=size,
            medium=chain["medium"],
            group_idx=chain["group"],
            lora_name=chain["namespace"].get("lora_name"),
            extra_keys=chain["namespace"].get("extra_keys") if first else None,
        )
        chain["parent"] = hashes[-1]
        chain["stored"] = start + covered
        self.known += [(h, chain["medium"], chain["group"]) for h in hashes]
        return event

    def batch(self) -> list[KVEvent]:
        rand = self.rand
        events: list[KVEvent] = []
        for _ in range(rand.randint(1, 8)):
            roll = rand.random()
            if roll < 0.55 or not self.chains:
                chain = (
                    self.new_chain() if rand.random() < 0.3 or not self.chains else rand.choice(self.chains)
                )
                event = self.store(chain, rand.choice([1, 1, 1, 2, 4, 16]))
                if event is not None:
                    events.append(event)
            elif roll < 0.65 and self.known:  # the same blocks announced again, in another tier
                block_hash, _, group = rand.choice(self.known)
                events.append(
                    BlockStored(
                        block_hashes=[block_hash], token_ids=[], block_size=16, medium="cpu", group_idx=group
                    )
                )
            elif roll < 0.9 and self.known:
                picked = rand.sample(self.known, min(len(self.known), rand.randint(1, 4)))
                medium, group = picked[0][1], picked[0][2]
                hashes = [h for h, m, g in picked if m == medium and g == group]
                events.append(BlockRemoved(block_hashes=[*hashes, 10**9], medium=medium, group_idx=group))
            elif roll < 0.93:
                events.append(AllBlocksCleared())
            else:  # a stranger: block whose parent was never announced
                events.append(BlockStored(block_hashes=[10**10 + len(events)], parent_block_hash=-5,
                                          token_ids=self.docs[0][:16], block_size=16))  # fmt: skip
        return events


def apply_through_general_path(index: PrefixIndex, backend: str, events: list[KVEvent]) -> None:
    """The reference: every event applied on its own by the general (one event, any shape) code."""
    index.add_backend(backend)
    with index._lock:
        state = index._backends[backend]
        for event in events:
            if isinstance(event, BlockStored):
                index.writer.rules.store_locked(state, event)
            elif isinstance(event, BlockRemoved):
                index.writer.rules.remove_locked(state, event)
            else:
                state.stats.cleared_events += 1
                index.clear_locked(state)


def assert_same_lookups(reference: PrefixIndex, others: list[PrefixIndex], docs: list) -> None:
    """Every index answers every document's lookup as `reference` does, in each namespace the
    streams use (plain, a LoRA adapter, a cache salt)."""
    for doc in docs:
        for namespace in ((None, None), ("lora-a", None), (None, "salt-1")):
            expected = reference.longest_cached_prefix(doc, namespace)
            for index in others:
                assert index.longest_cached_prefix(doc, namespace) == expected


def internal_state(index: PrefixIndex, backend: str) -> dict[str, Any]:
    """What `index` keeps, shared and for `backend`, in a form `==` compares."""
    state = index._backends[backend]
    nodes = {key: (*node[:4], owned_keys(node[4]), *node[5:]) for key, node in state.nodes.items()}
    return {
        "holders": index.holders,
        "extra_refs": index.extra_refs,
        "tails": index._tails,
        "tail_refs": index._tail_refs,
        "nodes": nodes,
        "chains": {cid: (c.preview, c.namespace, c.longest, c.nodes) for cid, c in state.chains.items()},
        "stats": index.stats(backend),
        "top": index.top_prefixes(50),
        "lora_names": index.lora_names,
    }


def decode_streams(maker: StreamMaker, rounds: int):
    """Random calls of `apply` as the subscriber makes them: lone one-block events, decode steps of
    several requests, drained bursts (several steps, parents earlier in the list) with prefills,
    removals, re-stores and clears between, and events the compiled path must refuse: duplicates,
    unknown parents, token ids outside uint32, the same prefix stored twice in a tier, other
    media, KV group 1, partial tails, roots."""
    rand = maker.rand
    next_stranger = iter(range(10**12, 10**13))

    def start_requests(count: int) -> list[dict[str, Any]]:
        chains = [maker.new_chain() for _ in range(count)]
        for chain in chains:
            maker.docs.append([rand.randrange(150_000) for _ in range(DOC_TOKENS)])
            chain.update(
                block_size=16,
                overlap=False,
                group=rand.choice([None, None, None, 0, 1]),
                medium=rand.choice([None, "GPU", "GPU", "cpu"]),
                doc=len(maker.docs) - 1,
            )
        return chains

    def step(chains: list[dict[str, Any]]) -> list[KVEvent]:
        return [event for chain in chains if (event := maker.store(chain, 1)) is not None]

    decoding = start_requests(rand.randint(1, 6))
    applied: list[BlockStored] = []
    for _ in range(rounds):
        roll = rand.random()
        if roll < 0.25:
            events = step([rand.choice(decoding)])
        elif roll < 0.5:
            events = step(decoding)
        elif roll < 0.85:
            events = []
            for _ in range(rand.randint(2, 12)):
                events += step(decoding)
                if rand.random() < 0.3:
                    events += maker.batch()
        else:
            events = maker.batch()
        for _ in range(rand.randint(0, 3)):  # hazards, at random places
            chain = rand.choice(decoding)
            doc, at = maker.docs[chain["doc"]], chain["stored"]
            tokens = doc[at : at + 16] if at + 16 <= len(doc) else doc[:16]
            hazard = rand.choice(["duplicate", "unknown parent", "not uint32", "twin", "tail", "root"])
            if hazard == "duplicate" and applied:
                event: KVEvent = rand.choice(applied)
            elif hazard == "unknown parent":
                event = BlockStored(
                    block_hashes=[next(next_stranger)], parent_block_hash=-7, token_ids=tokens, block_size=16
                )
            elif hazard == "not uint32":
                bad = rand.choice([-1, 2**32, 2**64 + 5, 1.5])
                event = BlockStored(
                    block_hashes=[next(next_stranger)],
                    parent_block_hash=chain["parent"],
                    token_ids=[*tokens[:15], bad],
                    block_size=16,
                    medium=chain["medium"],
                )
            elif hazard == "twin":  # the next block under another hash: a prefix the tier holds
                twin = maker.store(chain, 1)
                if twin is None:
                    continue
                events.append(twin)
                event = BlockStored(
                    block_hashes=[next(next_stranger)],
                    parent_block_hash=twin.parent_block_hash,
                    token_ids=twin.token_ids,
                    block_size=16,
                    medium=twin.medium,
                    group_idx=twin.group_idx,
                )
            elif hazard == "tail":  # a partial block, then a child of it
                partial = BlockStored(
                    block_hashes=[next(next_stranger)],
                    parent_block_hash=chain["parent"],
                    token_ids=tokens[:9],
                    block_size=16,
                    medium=chain["medium"],
                )
                events.append(partial)
                event = BlockStored(
                    block_hashes=[next(next_stranger)],
                    parent_block_hash=partial.block_hashes[0],
                    token_ids=tokens,
                    block_size=16,
                )
            else:
                event = BlockStored(block_hashes=[next(next_stranger)], token_ids=tokens, block_size=16)
            events.insert(rand.randrange(len(events) + 1), event)
        if applied and rand.random() < 0.4:  # evictions as vLLM announces them: one block an event
            for victim in rand.sample(applied, min(len(applied), rand.randint(1, 3))):
                removal = BlockRemoved(
                    block_hashes=victim.block_hashes[-1:], medium=victim.medium, group_idx=victim.group_idx
                )
                events.insert(rand.randrange(len(events) + 1), removal)
        applied += [event for event in events if isinstance(event, BlockStored)][-20:]
        if any(isinstance(event, AllBlocksCleared) for event in events) or rand.random() < 0.05:
            decoding = start_requests(rand.randint(1, 6))  # the engine dropped everything, or new requests
        yield events
