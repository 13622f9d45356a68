"""A loaded tokenizer's objects are out of the cyclic collector's reach (router/tokenize.py)."""

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


def test_loading_a_tokenizer_freezes_its_objects_so_full_collections_skip_them() -> None:
    # A fresh process: what this test process holds already (other fixtures) does not count.
    output = subprocess.run(
        [sys.executable, "-c", PROBE, builtin_tokenizer_dir("qwen3")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    frozen, still_tracked = int(output[0]), int(output[1])
    assert frozen > 150_000  # the vocabulary and merges of the Qwen3 tokenizer, and everything before
    assert still_tracked < frozen // 4  # a full collection walks only what came after
    assert gc.isenabled()  # frozen, not switched off: later garbage is still collected
