"""Lookups with the prompt's router keys passed in (`longest_cached_prefix(..., keys=...)`): the same
answers as lookups that compute them, without reading the prompt beyond the matched blocks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from kvgate_testing.index_oracle import WritableIndex
from kvwire import BlockRemoved, BlockStored
from router.index.keys import namespace_seed, prefix_keys, prompt_prefix_keys
from router.index.store import PrefixIndex

rng = np.random.default_rng(11)
DOC = rng.integers(0, 150_000, size=40_000).tolist()


def chain(tokens: list[int], block_size: int, first_hash: int, **kw) -> list[BlockStored]:
    events, parent = [], None
    for i, start in enumerate(range(0, len(tokens), block_size)):
        events.append(
            BlockStored(
                block_hashes=[first_hash + i],
                parent_block_hash=parent,
                token_ids=tokens[start : start + block_size],
                block_size=min(block_size, len(tokens) - start),
                **kw,
            )
        )
        parent = first_hash + i
    return events


def mixed_index() -> PrefixIndex:
    """Backends of every shape: whole blocks, cache-layer chunks with a short tail chunk, CPU and
    disk tiers, a hole, a salted namespace and a long document past the first 32k-token span."""
    index = WritableIndex()
    index.apply("gpu16", chain(DOC[:4096], 16, 1))
    index.apply("chunks", chain(DOC[:1000], 256, 1, medium="cpu"))  # ends 8 tokens off a boundary
    index.apply("tiers", chain(DOC[:512], 16, 1))
    index.apply("tiers", chain(DOC[:2048], 16, 1, medium="cpu"))
    index.apply("tiers", chain(DOC[:3072], 16, 1, medium="LocalDiskBackend"))
    index.apply("holed", chain(DOC[:8192], 16, 1))
    index.apply("holed", [BlockRemoved(block_hashes=[300])])
    long_doc = BlockStored(block_hashes=list(range(1, 2301)), token_ids=DOC[:36_800], block_size=16)
    index.apply("long", [long_doc])
    index.apply(
        "salted",
        chain(DOC[:640], 16, 1, extra_keys=[["salt-1"]] + [None] * 39),
    )
    return index


PROMPTS = {
    "short": DOC[:15],
    "1k": DOC[:1024],
    "8k": DOC[:8192],
    "diverging": [*DOC[:1500], *rng.integers(0, 150_000, size=600).tolist()],
    "40k": DOC,
}


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
@pytest.mark.parametrize("namespace", [(None, None), (None, "salt-1")])
def test_answers_equal_with_and_without_keys(prompt_name: str, namespace: tuple) -> None:
    index = mixed_index()
    prompt = PROMPTS[prompt_name]
    expected = index.longest_cached_prefix(prompt, namespace)
    keys = prompt_prefix_keys(prompt, namespace)
    assert index.longest_cached_prefix(prompt, namespace, keys=keys) == expected
    as_array = np.asarray(keys, dtype=np.uint64)
    assert index.longest_cached_prefix(np.asarray(prompt), namespace, keys=as_array) == expected
    some = ["tiers", "x"]
    assert index.longest_cached_prefix(tuple(prompt), namespace, some, keys=keys) == (
        index.longest_cached_prefix(prompt, namespace, some)
    )
    if prompt_name == "8k" and namespace == (None, None):  # the shapes really differ, not all zero
        assert {name: match.tokens for name, match in expected.items()} == {
            "gpu16": 4096, "chunks": 1000, "tiers": 3072, "holed": 299 * 16, "long": 8192, "salted": 0,
        }  # fmt: skip
        assert expected["tiers"].cumulative == [("gpu", 512), ("cpu", 2048), ("disk", 3072)]


def test_keys_from_more_than_64_slots() -> None:
    index = WritableIndex()
    for n in range(70):
        index.apply(f"b{n}", chain(DOC[: 16 * (n % 5 + 1)], 16, 1))
    prompt = DOC[:1024]
    with_keys = index.longest_cached_prefix(prompt, keys=prompt_prefix_keys(prompt))
    assert with_keys == index.longest_cached_prefix(prompt)
    assert all(with_keys[f"b{n}"].tokens == 16 * (n % 5 + 1) for n in range(70))


class _SliceOnly(Sequence[int]):
    """A prompt that only allows slicing: any attempt to read it whole fails the test."""

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, index):  # type: ignore[override]
        if not isinstance(index, slice) or (index.stop or len(self)) - (index.start or 0) > 16:
            raise AssertionError(f"the lookup read the prompt beyond one block: {index!r}")
        return self._tokens[index]

    def __iter__(self):
        raise AssertionError("the lookup iterated over the whole prompt")


def test_a_lookup_with_keys_reads_the_prompt_only_past_the_match() -> None:
    index = mixed_index()
    prompt = PROMPTS["8k"]
    result = index.longest_cached_prefix(_SliceOnly(prompt), keys=prompt_prefix_keys(prompt))
    assert result == index.longest_cached_prefix(prompt)
    assert result["chunks"].tokens == 1000  # the 8-token tail was read from the slice


def test_a_key_count_that_does_not_fit_the_prompt_is_refused_with_the_fix() -> None:
    index = mixed_index()
    keys = prompt_prefix_keys(DOC[:1024])
    with pytest.raises(ValueError, match=r"64 full 16-token blocks.*prompt_prefix_keys"):
        index.longest_cached_prefix(DOC[:1024], keys=keys[:-1])
    with pytest.raises(ValueError, match="keys: 64 given for a prompt of 2048 tokens"):
        index.longest_cached_prefix(DOC[:2048], keys=keys)


def test_prompt_prefix_keys_is_prefix_keys_from_the_namespace_seed() -> None:
    """What callers pass: the numpy form and the list form are the same keys."""
    prompt = np.asarray(DOC[:4096], dtype=np.uint32)
    index = WritableIndex()
    keys = prompt_prefix_keys(prompt, ("lora", None))
    assert keys == prefix_keys(prompt, namespace_seed(("lora", None))).tolist()
    assert index.longest_cached_prefix(prompt, ("lora", None), keys=keys) == {}
