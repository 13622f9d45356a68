"""Build the small Llama-3-style test tokenizer (tests/data/bos_tokenizer/): one that adds a BOS token.

Every other tokenizer in the tests is Qwen3's, which adds no beginning-of-sequence token, so token
parity for Llama- and Mistral-style models (a chat template that writes the BOS itself, an encode
that adds it for plain text) would go untested; model hubs cannot be reached from the test machines.
This script trains a byte-level BPE of TARGET_VOCAB tokens on a corpus written below, with Llama 3's
pipeline around it:
- pre-tokenizer: Llama 3's split regex (isolated), then ByteLevel without its own regex;
- post-processor: ByteLevel, then a template that puts `<|begin_of_text|>` before the text
  (what Llama 3's tokenizer.json does: `encode(text)` starts with BOS, `add_special_tokens=False` not);
- added special tokens: Llama 3's header, end-of-turn and end-of-text tokens;
- tokenizer_config.json: `bos_token`, `add_bos_token`, and a Llama-3-style chat template that starts
  with `{{ bos_token }}` (so a chat rendered to text and encoded with special tokens would hold two).

Training is deterministic (one thread, a fixed corpus): running it again writes the same files, which
tests/test_tokenize_bos.py checks. Usage: python scripts/build_bos_tokenizer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "data" / "bos_tokenizer"
TARGET_VOCAB = 1200
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3's pre-tokenizer regex (its tokenizer.json, "Split" with behavior "Isolated").
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's chat template, less the date and tool preamble of 3.1: BOS first, then each message as
# header, two newlines, the trimmed content and end-of-turn.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CORPUS = [
    "The gateway routes each request to the engine that already holds the longest prefix of its prompt.",
    "A KV cache keeps the keys and values of every attention layer: a repeated prefix is not computed again.",
    "When the GPU fills up, blocks are offloaded to CPU memory and later to disk, where they load slower.",
    "It's the router's job to count tokens exactly as the engine does; we'll check that they match.",
    "Documents, questions and answers: a chat's next turn repeats everything its previous turn said.",
    "Numbers such as 3.14, 2026, 512 tokens and 16-token blocks appear in logs, tables and benchmarks.",
    "Tabs\tand  double  spaces, new lines\nand blank lines\n\nare kept as they are written.",
    "Weather in Paris? Let me check. The temperature is 21 degrees and the sky is clear today.",
    "You are a helpful assistant. Answer briefly, and say so when you do not know the answer.",
    "Section 2 describes the cache layer; table 4 lists the results of each run, with their median.",
    "(see the appendix) -- naive codecs copy bytes; compressed ones quantize them first.",
    "user, assistant, system and tool messages each get a header and an end-of-turn token.",
    "Lighthouse keepers wrote logbooks every night: wind, waves, ships seen and the lamp's oil.",
    "Medieval bookbinding used glue recipes, sewing frames and wooden boards covered in leather.",
    "The first document is about tidal energy in northern fjords and how turbines are placed.",
    "I said: WE'LL meet at 9:30, don't be late! She'd answered that they've already left.",
    "ünïcödé, naïve café, e\u0301t\u00e9, 中文 and 😀 are encoded byte by byte where the merges stop.",
    "KV-aware routing, prefix hits, cache misses, load balancing, prefill and decode throughput.",
]


def corpus() -> list[str]:
    """The training text: the sentences above, and each again lower-cased and joined in pairs, so
    that common words merge into whole tokens and rarer ones stay split (as a real vocabulary does)."""
    lines = list(CORPUS)
    lines += [line.lower() for line in CORPUS]
    lines += [f"{a} {b}" for a, b in itertools.pairwise(CORPUS)]
    return lines


def build(out: Path) -> None:
    """Train the tokenizer and write tokenizer.json and tokenizer_config.json into `out`."""
    # One thread: the trainer's merges are then the same on every run.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    # One line per vocabulary entry and merge would double the size: written compact, sorted keys.
    description = json.loads(tokenizer.to_str())
    (out / "tokenizer.json").write_text(json.dumps(description, ensure_ascii=False, sort_keys=True) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|eot_id|>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": True,
        "model_max_length": 131072,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    args = parser.parse_args()
    build(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
