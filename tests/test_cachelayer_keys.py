"""Chunk keys: chained, identity-bound, deterministic across processes; canonical CBOR encoding."""

import os
import subprocess
import sys

import pytest

from cachelayer.keys import CacheIdentity, cbor_encode, chunk_spans


@pytest.mark.parametrize(
    ("value", "expected_hex"),
    [  # RFC 8949 appendix A
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (100, "1864"),
        (1000, "1903e8"),
        (1000000, "1a000f4240"),
        (1000000000000, "1b000000e8d4a51000"),
        (18446744073709551615, "1bffffffffffffffff"),
        (-1, "20"),
        (-100, "3863"),
        ("a", "6161"),
        ("\u00fc", "62c3bc"),
        (b"", "40"),
        ([1, [2, 3], [4, 5]], "8301820203820405"),
        (None, "f6"),
        (True, "f5"),
    ],
)
def test_cbor_encoding_matches_rfc_8949_examples(value, expected_hex):
    assert cbor_encode(value).hex() == expected_hex


@pytest.mark.parametrize("algorithm", ["sha256_cbor_64bit", "xxhash"])
def test_chunks_cover_tokens_and_chain_parents(algorithm):
    spans = chunk_spans(list(range(10)), chunk_size=4, identity=CacheIdentity(), algorithm=algorithm)
    assert [(span.start, span.end) for span in spans] == [(0, 4), (4, 8), (8, 10)]
    assert spans[0].parent_key is None
    assert [span.parent_key for span in spans[1:]] == [spans[0].key, spans[1].key]
    assert all(0 <= span.key < 2**64 for span in spans)
    without_tail = chunk_spans(
        list(range(10)), chunk_size=4, identity=CacheIdentity(), algorithm=algorithm, save_unfull_chunk=False
    )
    assert [(span.start, span.end) for span in without_tail] == [(0, 4), (4, 8)]


@pytest.mark.parametrize("algorithm", ["sha256_cbor_64bit", "xxhash"])
def test_identity_and_prefix_change_the_key(algorithm):
    def first_keys(tokens, **identity):
        return [
            s.key
            for s in chunk_spans(
                tokens, chunk_size=4, identity=CacheIdentity(**identity), algorithm=algorithm
            )
        ]

    base = first_keys([1, 2, 3, 4, 5, 6, 7, 8])
    assert first_keys([1, 2, 3, 4, 5, 6, 7, 8]) == base
    for identity in (
        {"cache_salt": "s"},
        {"lora": "adapter"},
        {"model": "m"},
        {"worker_id": 1},
        {"dtype": "float16"},
    ):
        assert first_keys([1, 2, 3, 4, 5, 6, 7, 8], **identity)[0] != base[0], identity
    # The same second-chunk tokens after a different first chunk give a different key (chaining).
    assert first_keys([9, 2, 3, 4, 5, 6, 7, 8])[1] != base[1]


def test_sha256_cbor_64bit_is_the_documented_construction():
    import hashlib

    span = chunk_spans([1, 2, 300], chunk_size=4, identity=CacheIdentity(model="m", dtype="bfloat16"))[0]
    encoded = cbor_encode([None, [1, 2, 300], ["m", "bfloat16", 1, 0, None, None]])
    assert span.key == int.from_bytes(hashlib.sha256(encoded).digest()[-8:], "big")


def test_keys_are_identical_across_processes_with_different_hash_seeds():
    code = (
        "from cachelayer.keys import CacheIdentity, chunk_spans;"
        "identity = CacheIdentity(model='m', cache_salt='x');"
        "print([[s.key for s in chunk_spans(list(range(40)), chunk_size=16, identity=identity, algorithm=a)]"
        " for a in ('sha256_cbor_64bit', 'xxhash')])"
    )
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1


def test_unknown_algorithm_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown hash algorithm 'md5'"):
        chunk_spans([1], chunk_size=4, identity=CacheIdentity(), algorithm="md5")


def test_vectorized_token_encoding_equals_the_reference_encoder():
    import numpy as np

    from cachelayer.keys import _cbor_token_array

    edges = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
    values = np.array(edges + list(range(0, 200_000, 997)), dtype=np.int64)
    assert _cbor_token_array(values) == cbor_encode(values.tolist())
    assert _cbor_token_array(np.array([], dtype=np.int64)) == cbor_encode([])
