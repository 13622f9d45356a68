"""Mutation fuzzing of the compiled code that reads what sockets bring: the KV-event scan
(kvwire/_frames.pyx `scan_batch`, router/index/_ingest.pyx's wire ingest) and the ASCII encoder's split and
pretoken table (router/_ascii_split.pyx, behind `PromptTokenizer.encode_text`).

    python -m kvgate_testing.fuzz_compiled [--seconds 300] [--seed 1] [--target wire|text|all]

Run by `make fuzz` (scripts/fuzz_compiled.sh) against a copy of the extensions built with
AddressSanitizer, so a read or write out of bounds aborts the run with its report; each target also
asserts its answers: payloads scanned only as the msgpack decoder reads them, to the index the
decoded events build (kvgate_testing.wire_payloads.check_scan), and texts encoded token for token
as the tokenizer encodes them. Random mutations of valid inputs, no coverage guidance: the
extensions are not instrumented for it.
"""

from __future__ import annotations

import argparse
import importlib
import random
import sys
import time

import numpy as np

from kvgate_testing.index_streams import StreamMaker
from kvgate_testing.wire_payloads import check_scan, mutate, payload_corpus

# Pieces of text that reach the split's and the table's edges: contractions, whitespace runs,
# digit runs, long symbol runs, long words, added tokens, a non-ASCII letter.
TEXT_PIECES = [
    "'s", "'T", "'ll", "'VE", "  ", "\n\n", "\r\n", " \n ", "\t", " 123", "4567", "!!!", "...", "x" * 300,
    " " * 70, "-" * 500, "0" * 40, "<|im_end|>", "<|im_start|>", "<think>", "é",
]  # fmt: skip
WORDS = ["the", "cache", "Router", "A", "I", "x2", "3.14", "don't", "e.g.", "URL:"]


def fuzz_wire(seconds: float, seed: int) -> dict[str, int]:
    rand = random.Random(seed)
    corpus = payload_corpus(rand, StreamMaker(seed), 400)
    outcomes = {"refused": 0, "decoded only": 0, "scanned": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        payload = mutate(rand, rand.choice(corpus), corpus)
        outcome = check_scan(payload)
        outcomes[outcome] += 1
        if outcome == "scanned" and rand.random() < 0.2 and len(corpus) < 20_000:
            corpus.append(payload)  # corruptions the scan reads are mutated further
    return outcomes


def fuzz_text(seconds: float, seed: int) -> dict[str, int]:
    from router.config import builtin_tokenizer_dir
    from router.tokenize import PromptTokenizer

    tokenizer = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
    if tokenizer._ascii is None:
        raise SystemExit("the ASCII encoder is off for qwen3: nothing compiled to fuzz")
    rand = random.Random(seed)
    alphabet = [chr(code) for code in range(128)]
    history = [""]

    def text() -> str:
        parts = []
        for _ in range(rand.randint(1, 30)):
            roll = rand.random()
            if roll < 0.4:
                parts.append("".join(rand.choices(alphabet, k=rand.randint(1, 20))))
            elif roll < 0.7:
                parts.append(rand.choice(TEXT_PIECES))
            else:
                parts.append(" ".join(rand.choices(WORDS, k=rand.randint(1, 10))))
        new = "".join(parts)
        roll = rand.random()
        if roll < 0.3:  # a text that continues an earlier one: the prompt memory, the cut memory
            new = rand.choice(history) + new
        elif roll < 0.4:  # long: segments
            new = (rand.choice(history) + new) * rand.randint(2, 5)
        return new[:40_000]

    texts = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sample = text()
        history.append(sample)
        del history[:-16]
        got = tokenizer.encode_text(sample, add_special_tokens=False)
        expected = tokenizer.tokenizer.encode(sample, add_special_tokens=False)
        assert np.array_equal(got, np.asarray(expected, dtype=np.uint32)), repr(sample)
        texts += 1
    return {"texts": texts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0, help="per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", choices=["wire", "text", "all"], default="all")
    args = parser.parse_args(argv)
    for name in ("kvwire._frames", "router.index._ingest", "router._ascii_split"):
        module = importlib.import_module(name)
        print(f"{name}: {module.__file__}", flush=True)
    if args.target in ("wire", "all"):
        print(f"wire: {fuzz_wire(args.seconds, args.seed)}", flush=True)
    if args.target in ("text", "all"):
        print(f"text: {fuzz_text(args.seconds, args.seed)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
