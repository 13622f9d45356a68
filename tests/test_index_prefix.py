"""The prefix index: contiguous cached prefixes per backend and tier, whatever the block sizes."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvgate_testing.index_oracle import WritableIndex
from kvwire import AllBlocksCleared, BlockRemoved, BlockStored
from router.index.keys import ROUTER_BLOCK_TOKENS, namespace_seed, prefix_keys, small_prefix_keys
from router.index.store import PrefixIndex

rng = np.random.default_rng(7)
PROMPT = rng.integers(0, 150_000, size=1024).tolist()


def stored_chain(
    tokens: list[int],
    block_size: int,
    first_hash: int,
    *,
    medium: str | None = None,
    overlap: bool = False,
    **kw,
) -> list[BlockStored]:
    """One BlockStored per block, each naming its parent, like an engine announcing a prefill."""
    events = []
    parent = None
    for i, start in enumerate(range(0, len(tokens), block_size)):
        chunk = tokens[start : start + block_size + (1 if overlap else 0)]
        size = min(block_size, len(tokens) - start)
        events.append(
            BlockStored(
                block_hashes=[first_hash + i],
                parent_block_hash=parent,
                token_ids=chunk,
                block_size=size,
                medium=medium,
                **(kw if i == 0 else {k: v for k, v in kw.items() if k != "extra_keys"}),
            )
        )
        parent = first_hash + i
    return events


def cached(index: PrefixIndex, tokens: list[int], backend: str, **kw) -> int:
    return index.longest_cached_prefix(tokens, **kw)[backend].tokens


def test_python_and_numpy_keys_agree() -> None:
    tokens = np.asarray(PROMPT[:160], dtype=np.uint32)
    for first_block in (0, 3, 1000):
        assert (
            small_prefix_keys(tokens.tolist(), 99, first_block)
            == prefix_keys(tokens, 99, first_block).tolist()
        )


def test_vllm_blocks_in_one_event_then_removal_cuts_the_prefix() -> None:
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=list(range(8)), token_ids=PROMPT[:256], block_size=32)])
    assert cached(index, PROMPT, "a") == 256
    assert cached(index, PROMPT[:100], "a") == 96  # only whole router blocks of the prompt
    index.apply("a", [BlockRemoved(block_hashes=[3])])
    assert cached(index, PROMPT, "a") == 96
    stats = index.stats("a")
    assert stats is not None and stats.blocks == {"gpu": 7} and stats.tokens == {"gpu": 224}


def test_different_block_sizes_across_backends_answer_in_tokens() -> None:
    index = WritableIndex()
    index.apply("vllm16", stored_chain(PROMPT[:320], 16, 1))
    index.apply("vllm32", stored_chain(PROMPT[:320], 32, 1))
    # Cache layer: 256-token chunks with a short tail chunk, one-token overlap, medium "cpu".
    index.apply("chunks", stored_chain(PROMPT[:300], 256, 1, medium="cpu", overlap=True))
    # LMCache-style 8-token chunks with overlap.
    index.apply("lmcache8", stored_chain(PROMPT[:40], 8, 1, medium="CPU", overlap=True))
    result = index.longest_cached_prefix(PROMPT)
    assert {name: match.tokens for name, match in result.items()} == {
        "vllm16": 320,
        "vllm32": 320,
        "chunks": 300,
        "lmcache8": 40,
    }
    assert result["chunks"].by_tier == {"cpu": 300}


def test_a_prompt_that_diverges_inside_a_block_matches_up_to_the_block_before() -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:128], 16, 1))
    other = [*PROMPT[:70], 1, 2, 3, *PROMPT[73:128]]
    assert cached(index, other, "a") == 64


def test_tiers_are_reported_separately_and_cumulatively() -> None:
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=[1, 2], token_ids=PROMPT[:64], block_size=32, medium="GPU")])
    index.apply(
        "a", [BlockStored(block_hashes=[1, 2, 3, 4], token_ids=PROMPT[:128], block_size=32, medium="CPU")]
    )
    match = index.longest_cached_prefix(PROMPT)["a"]
    assert match.by_tier == {"gpu": 64, "cpu": 128}
    assert match.cumulative == [("gpu", 64), ("cpu", 128)]
    assert match.best_tier() == "cpu"
    # Evicted from GPU, still on CPU.
    index.apply("a", [BlockRemoved(block_hashes=[1, 2], medium="GPU")])
    match = index.longest_cached_prefix(PROMPT)["a"]
    assert match.by_tier == {"gpu": 0, "cpu": 128}


def test_gpu_and_cpu_pieces_combine_into_one_contiguous_prefix() -> None:
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=[1, 2], token_ids=PROMPT[:64], block_size=32, medium="GPU")])
    cpu_child = BlockStored(
        block_hashes=[3], parent_block_hash=2, token_ids=PROMPT[64:96], block_size=32, medium="CPU"
    )
    index.apply("a", [cpu_child])
    match = index.longest_cached_prefix(PROMPT)["a"]
    assert match.by_tier == {"gpu": 64, "cpu": 0}
    assert match.cumulative == [("gpu", 64), ("cpu", 96)]


def test_salted_and_lora_prompts_never_match_other_namespaces() -> None:
    index = WritableIndex()
    index.apply("plain", stored_chain(PROMPT[:64], 16, 1))
    index.apply("salted", stored_chain(PROMPT[:64], 16, 1, extra_keys=[["secret"], None, None, None]))
    index.apply("lora", stored_chain(PROMPT[:64], 16, 1, lora_name="sql", extra_keys=[["sql"]]))
    unsalted = index.longest_cached_prefix(PROMPT)
    assert {n: m.tokens for n, m in unsalted.items()} == {"plain": 64, "salted": 0, "lora": 0}
    salted = index.longest_cached_prefix(PROMPT, namespace=(None, "secret"))
    assert {n: m.tokens for n, m in salted.items()} == {"plain": 0, "salted": 64, "lora": 0}
    wrong_salt = index.longest_cached_prefix(PROMPT, namespace=(None, "guess"))
    assert all(m.tokens == 0 for m in wrong_salt.values())
    assert cached(index, PROMPT, "lora", namespace=("sql", None)) == 64
    assert namespace_seed((None, None)) != namespace_seed((None, "secret"))


def test_a_block_whose_parent_is_unknown_is_counted_not_guessed() -> None:
    index = WritableIndex()
    index.apply(
        "a", [BlockStored(block_hashes=[5], parent_block_hash=4, token_ids=PROMPT[64:80], block_size=16)]
    )
    assert cached(index, PROMPT, "a") == 0
    stats = index.stats("a")
    assert stats is not None and stats.unplaced_blocks == 1


def test_all_blocks_cleared_and_clear_backend_forget_only_that_backend() -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:64], 16, 1))
    index.apply("b", stored_chain(PROMPT[:64], 16, 1))
    index.apply("a", [AllBlocksCleared()])
    assert cached(index, PROMPT, "a") == 0
    assert cached(index, PROMPT, "b") == 64
    index.clear_backend("b")
    assert cached(index, PROMPT, "b") == 0
    assert index.size()["router_keys"] == 0


def test_the_same_prefix_in_two_kv_cache_groups_needs_both_removed() -> None:
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=[1], token_ids=PROMPT[:16], block_size=16, group_idx=0)])
    index.apply("a", [BlockStored(block_hashes=[1], token_ids=PROMPT[:16], block_size=16, group_idx=1)])
    index.apply("a", [BlockRemoved(block_hashes=[1], group_idx=1)])
    assert cached(index, PROMPT, "a") == 16
    index.apply("a", [BlockRemoved(block_hashes=[1], group_idx=0)])
    assert cached(index, PROMPT, "a") == 0


def test_removing_unknown_blocks_is_counted_and_harmless() -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:32], 16, 1))
    index.apply("a", [BlockRemoved(block_hashes=[999, b"zz"])])
    assert cached(index, PROMPT, "a") == 32
    stats = index.stats("a")
    assert stats is not None and stats.unknown_removals == 2


def test_removed_backend_frees_its_slots_for_new_ones() -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:32], 16, 1))
    index.remove_backend("a")
    assert index.longest_cached_prefix(PROMPT) == {}
    index.apply("b", stored_chain(PROMPT[:48], 16, 1))
    assert index.longest_cached_prefix(PROMPT)["b"].tokens == 48


def test_more_than_64_backend_tier_slots() -> None:
    index = WritableIndex()
    for n in range(70):
        index.apply(f"b{n}", stored_chain(PROMPT[: 16 * (n % 5 + 1)], 16, 1))
    result = index.longest_cached_prefix(PROMPT)
    assert len(result) == 70
    assert all(result[f"b{n}"].tokens == 16 * (n % 5 + 1) for n in range(70))


def test_restricting_the_lookup_to_some_backends() -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:32], 16, 1))
    index.apply("b", stored_chain(PROMPT[:64], 16, 1))
    result = index.longest_cached_prefix(PROMPT, backends=["b", "unknown"])
    assert set(result) == {"b", "unknown"}
    assert result["b"].tokens == 64 and result["unknown"].tokens == 0


def test_top_prefixes_merge_backends_and_rank_by_length() -> None:
    index = WritableIndex()
    other = rng.integers(0, 150_000, size=64).tolist()
    index.apply("a", stored_chain(PROMPT[:128], 16, 1))
    index.apply("b", stored_chain(PROMPT[:64], 16, 1))
    index.apply("b", stored_chain(other, 16, 100))
    top = index.top_prefixes()
    assert top[0]["tokens"] == 128
    assert top[0]["backends"] == {"a": 128, "b": 64}
    assert top[0]["blocks"] == {"a": 8, "b": 4}  # engine blocks of the chain on each backend
    assert top[1]["tokens"] == 64 and top[1]["backends"] == {"b": 64}
    assert top[0]["preview_tokens"][:ROUTER_BLOCK_TOKENS] == PROMPT[:ROUTER_BLOCK_TOKENS]


def test_lookups_during_concurrent_writes_stay_consistent() -> None:
    index = WritableIndex()
    index.apply("steady", stored_chain(PROMPT[:256], 16, 1))
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for round_ in range(200):
                index.apply("churn", stored_chain(PROMPT[:256], 16, 10_000 + round_ * 100))
                index.apply("churn", [AllBlocksCleared()])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            stop.set()

    writer = threading.Thread(target=churn)
    writer.start()
    lookups = 0
    while not stop.is_set() or lookups == 0:
        result = index.longest_cached_prefix(PROMPT)
        assert result["steady"].tokens == 256
        assert result.get("churn") is None or result["churn"].tokens in range(0, 257, 16)
        lookups += 1
    writer.join()
    assert not errors
    assert lookups > 0


@pytest.mark.parametrize("length", [0, 5, 16, 17])
def test_short_prompts(length: int) -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:32], 16, 1))
    assert cached(index, PROMPT[:length], "a") == (length // 16) * 16


def test_batched_and_one_by_one_application_agree() -> None:
    """The batched numpy path (many events per batch) must give exactly what one-by-one gives."""
    local = np.random.default_rng(5)
    docs = [local.integers(0, 150_000, size=512).tolist() for _ in range(6)]
    batches: list[list] = []
    chains: dict[int, tuple[int, int]] = {}  # doc -> (last hash, tokens stored)
    next_hash = 1
    for _ in range(40):
        batch = []
        for doc in local.choice(6, size=4, replace=False).tolist():
            last_hash, stored = chains.get(doc, (None, 0))
            size = int(local.choice([16, 32, 8, 48]))
            count = int(local.integers(1, 4))
            if stored + size * count > 512:
                batch.append(BlockRemoved(block_hashes=[last_hash] if last_hash else [12345]))
                continue
            hashes = list(range(next_hash, next_hash + count))
            next_hash += count
            medium = "CPU" if doc == 5 else "GPU"
            batch.append(
                BlockStored(
                    block_hashes=hashes,
                    parent_block_hash=last_hash,
                    token_ids=docs[doc][stored : stored + size * count],
                    block_size=size,
                    medium=medium,
                )
            )
            chains[doc] = (hashes[-1], stored + size * count)
        batches.append(batch)
    batched, one_by_one = WritableIndex(), WritableIndex()
    for batch in batches:
        batched.apply("a", batch)
        for event in batch:
            one_by_one.apply("a", [event])
    for doc in docs:
        assert batched.longest_cached_prefix(doc)["a"] == one_by_one.longest_cached_prefix(doc)["a"]
    assert batched.stats("a") == one_by_one.stats("a")
    assert batched.size() == one_by_one.size()


def test_cumulative_tiers_with_a_short_tail_chunk() -> None:
    """Cache-layer chunks held on CPU and disk, the last one short: 44 tokens in every view."""
    index = WritableIndex()
    for medium in ("cpu", "disk"):
        index.apply(
            "a",
            [
                BlockStored(block_hashes=[1], token_ids=PROMPT[:16], block_size=16, medium=medium),
                BlockStored(
                    block_hashes=[2],
                    parent_block_hash=1,
                    token_ids=PROMPT[16:32],
                    block_size=16,
                    medium=medium,
                ),
                BlockStored(
                    block_hashes=[3],
                    parent_block_hash=2,
                    token_ids=PROMPT[32:44],
                    block_size=12,
                    medium=medium,
                ),
            ],
        )
    match = index.longest_cached_prefix(PROMPT)["a"]
    assert match.by_tier == {"cpu": 44, "disk": 44}
    assert match.cumulative == [("cpu", 44), ("disk", 44)]


def test_token_ids_that_are_not_uint32_are_counted_not_indexed() -> None:
    index = WritableIndex()
    index.apply(
        "a",
        [
            BlockStored(block_hashes=[1], token_ids=[-1] * 16, block_size=16),
            BlockStored(block_hashes=[2], token_ids=PROMPT[:16], block_size=16),
            BlockStored(block_hashes=[3], token_ids=[2**40] * 8, block_size=8),
        ],
    )
    assert cached(index, PROMPT, "a") == 16
    stats = index.stats("a")
    assert stats is not None and stats.unplaced_blocks == 2


@pytest.mark.parametrize("held_tokens", [2048, 3008, 8192, 16384])
def test_long_prompts_across_probe_chunks(held_tokens: int) -> None:
    """Lookups compute and probe keys in growing chunks; runs ending in any chunk are exact."""
    long_prompt = np.random.default_rng(held_tokens).integers(0, 150_000, size=16384).tolist()
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=list(range(1, held_tokens // 16 + 1)),
                                  token_ids=long_prompt[:held_tokens], block_size=16)])  # fmt: skip
    index.apply("b", [BlockStored(block_hashes=list(range(1, 3001 // 16 + 1)),
                                  token_ids=long_prompt[: 3001 // 16 * 16], block_size=16)])  # fmt: skip
    result = index.longest_cached_prefix(long_prompt)
    assert result["a"].tokens == held_tokens
    assert result["b"].tokens == 3001 // 16 * 16
    index.apply("a", [BlockRemoved(block_hashes=[150])])  # a hole in the second chunk
    assert index.longest_cached_prefix(long_prompt)["a"].tokens == min(held_tokens, 149 * 16)


@pytest.mark.parametrize(
    ("prompt_blocks", "held_blocks", "hole"),
    [
        (512, 512, 100),  # every key but one held: the whole span is fetched, the hole stops it
        (512, 300, 100),  # the bisection lands past the hole (held blocks first, then the hole)
        (512, 300, 299),  # the hole is the last held block
        (512, 300, 0),  # nothing before the hole
        (4200, 4100, 3000),  # a hole in the second 32k span
        (4200, 2100, None),  # the cached part ends just past the first span
    ],
)
def test_a_hole_anywhere_stops_the_run_there(prompt_blocks: int, held_blocks: int, hole: int | None) -> None:
    """Lookups find where the cached part ends by bisection, then fetch the masks before it in one
    call: a hole anywhere before that point (a removed middle block) still ends the run exactly."""
    prompt = np.random.default_rng(prompt_blocks + held_blocks).integers(0, 150_000, size=16 * prompt_blocks)
    index = WritableIndex()
    index.apply("a", [BlockStored(block_hashes=list(range(1, held_blocks + 1)),
                                  token_ids=prompt[: 16 * held_blocks].tolist(), block_size=16)])  # fmt: skip
    if hole is not None:
        index.apply("a", [BlockRemoved(block_hashes=[hole + 1])])
    expected = 16 * (held_blocks if hole is None else hole)
    assert index.longest_cached_prefix(prompt)["a"].tokens == expected
    assert index.longest_cached_prefix(prompt.tolist())["a"].tokens == expected


def test_prompts_given_as_lists_tuples_or_arrays_answer_alike() -> None:
    index = WritableIndex()
    index.apply("a", stored_chain(PROMPT[:64], 16, 1))
    for tokens in (
        PROMPT,
        tuple(PROMPT),
        np.asarray(PROMPT, dtype=np.int64),
        np.asarray(PROMPT, dtype=np.uint32),
    ):
        assert index.longest_cached_prefix(tokens)["a"].tokens == 64
    with pytest.raises(OverflowError):
        index.longest_cached_prefix([*PROMPT[:16], -1])
