"""A loaded tokenizer's objects are out of the cyclic collector's reach (router/tokenize/prompt.py)."""

from __future__ import annotations

import gc
import subprocess
import sys

from router.config import builtin_tokenizer_dir

PROBE = """
import gc, sys, time
from router.tokenize import PromptTokenizer
PromptTokenizer(sys.argv[1])
started = time.process_time()
gc.collect()
print(gc.get_freeze_count(), len(gc.get_objects()), time.process_time() - started)
"""


def run_probe(probe: str) -> list[str]:
    """What `probe` prints, run in a fresh process with the Qwen3 tokenizer's directory as argument
    (what this test process holds already, other fixtures, does not count)."""
    return subprocess.run(
        [sys.executable, "-c", probe, builtin_tokenizer_dir("qwen3")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()


def test_loading_a_tokenizer_freezes_its_objects_so_full_collections_skip_them() -> None:
    output = run_probe(PROBE)
    frozen, still_tracked = int(output[0]), int(output[1])
    assert frozen > 150_000  # the vocabulary and merges of the Qwen3 tokenizer, and everything before
    assert still_tracked < frozen // 4  # a full collection walks only what came after
    assert gc.isenabled()  # frozen, not switched off: later garbage is still collected


CACHE_PROBE = """
import gc, sys
import numpy as np
from router.tokenize import PromptTokenizer
tokenizer = PromptTokenizer(sys.argv[1])
rng = np.random.default_rng(3)
words = ["the", "cache", "router", "engine", "prefix", "token", "block", "event", "42", "it's"]
gc.collect()
before = len(gc.get_objects())
for chat in range(300):
    messages = [
        {"role": "system", "content": " ".join(rng.choice(words, size=60).tolist())},
        {"role": "user", "content": " ".join(rng.choice(words, size=40).tolist()) + f" {chat}"},
    ]
    tokenizer.tokens_for({"messages": messages})
gc.collect()
print(len(tokenizer.cache._entries), len(gc.get_objects()) - before)
"""


def test_cached_pieces_leave_nothing_for_the_collector_to_walk() -> None:
    output = run_probe(CACHE_PROBE)
    cached_pieces, new_tracked = int(output[0]), int(output[1])
    assert cached_pieces >= 300
    # The pieces' token arrays own their data: no buffer objects (each GC-tracked) kept behind them.
    assert new_tracked < cached_pieces // 4
