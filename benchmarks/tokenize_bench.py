"""Tokenization benchmark: chat prompts of about 1k and 8k tokens, first turn and follow-up turns.

Side by side in one run, with the real Qwen3 tokenizer and chat template:
- whole: what a router without a cache does every turn: render the template, encode all of it;
- kvgate: router/tokenize/ (render, cut after added tokens, encode only pieces not cached).
A first turn is a conversation the cache has never seen; a follow-up turn appends an assistant
answer and a new user question to the previous turn's messages; a new question sends the first
turn's long user message again with another question after the document, in the same message
(document QA: the per-message cache misses, the segment cache does not). Every kvgate result is
checked equal to the whole-prompt tokens.

Run: .venv/bin/python -m benchmarks.tokenize_bench [--conversations 20] [--out benchmarks/results]
Times are process CPU time per request (the machines are shared).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvgate_testing.provenance import with_source
from router.config import builtin_tokenizer_dir
from router.tokenize import PromptTokenizer

WORDS = [
    *("the cache router engine prefix token block model request latency memory document section table",),
    *("figure result method analysis system user answer question context window attention layer value",),
]
WORDS = [word for line in WORDS for word in line.split()]
KINDS = ("first_turn", "follow_up", "new_question")


def paragraph(rng: np.random.Generator, words: int) -> str:
    return " ".join(rng.choice(WORDS, size=words)).capitalize() + "."


def conversation(rng: np.random.Generator, target_tokens: int) -> list[dict]:
    # About 1.1 tokens per word with this vocabulary; the document carries the bulk of the prompt.
    return [
        {"role": "system", "content": "You are a careful assistant. Answer from the document."},
        {"role": "user", "content": paragraph(rng, int(target_tokens * 0.9)) + "\n\nSummarise the document."},
    ]


def whole_tokens(tokenizer: PromptTokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.tokenizer.encode(text, add_special_tokens=False)


def run(size: int, conversations: int, turns: int, rng: np.random.Generator) -> dict:
    tokenizer = PromptTokenizer(builtin_tokenizer_dir("qwen3"))
    samples: dict[str, dict[str, list[float]]] = {
        "first_turn": {"whole": [], "kvgate": []},
        "follow_up": {"whole": [], "kvgate": []},
        "new_question": {"whole": [], "kvgate": []},
    }
    prompt_tokens = []
    for _ in range(conversations):
        messages = conversation(rng, size)
        document = messages[1]["content"].removesuffix("Summarise the document.")
        questions = [
            [messages[0], {"role": "user", "content": document + paragraph(rng, 12) + "?"}]
            for _ in range(turns - 1)
        ]
        for turn in range(turns * 2 - 1):
            kind = "first_turn" if turn == 0 else "follow_up" if turn < turns else "new_question"
            if kind == "new_question":
                messages = questions[turn - turns]
            body = {"messages": messages}
            started = time.process_time()
            expected = whole_tokens(tokenizer, messages)
            samples[kind]["whole"].append(time.process_time() - started)
            started = time.process_time()
            got = tokenizer.tokens_for(body)
            samples[kind]["kvgate"].append(time.process_time() - started)
            assert got.tolist() == expected, "kvgate tokens differ from whole-prompt tokens"
            prompt_tokens.append(len(expected))
            if kind == "new_question":
                continue
            messages = [
                *messages,
                {"role": "assistant", "content": paragraph(rng, 60)},
                {"role": "user", "content": paragraph(rng, 20) + "?"},
            ]
    return {
        "target_tokens": size,
        "prompt_tokens_median": int(statistics.median(prompt_tokens)),
        "first_turn": {k: summary(v) for k, v in samples["first_turn"].items()},
        "follow_up": {k: summary(v) for k, v in samples["follow_up"].items()},
        "new_question": {k: summary(v) for k, v in samples["new_question"].items()},
        "cache": {"hits": tokenizer.cache.hits, "misses": tokenizer.cache.misses},
    }


def summary(values: list[float]) -> dict:
    values = sorted(values)
    return {
        "median_ms": statistics.median(values) * 1e3,
        "p90_ms": values[int(len(values) * 0.9)] * 1e3,
        "samples": len(values),
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    labels, whole, kvgate = [], [], []
    for size in sizes:
        for kind in KINDS:
            labels.append(f"{int(size) // 1024}k {kind.replace('_', ' ')}")
            whole.append(results["sizes"][size][kind]["whole"]["median_ms"])
            kvgate.append(results["sizes"][size][kind]["kvgate"]["median_ms"])
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.2, whole, 0.4, label="render + encode whole prompt")
    ax.bar(x + 0.2, kvgate, 0.4, label="kvgate (per-message and segment cache)")
    ax.set_xticks(x, labels)
    ax.set_ylabel("median CPU ms per request")
    ax.set_title("Chat tokenization, Qwen3 tokenizer and template")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rng = np.random.default_rng(7)
    results = {
        "benchmark": "tokenize_bench",
        "command": (
            f"python -m benchmarks.tokenize_bench --conversations {args.conversations} --turns {args.turns}"
        ),
        "machine": {
            "python": platform.python_version(),
            "load_average": Path("/proc/loadavg").read_text().split()[:3],
        },
        "sizes": {},
    }
    for size in (1024, 8192):
        results["sizes"][str(size)] = run(size, args.conversations, args.turns, rng)
        for kind in KINDS:
            entry = results["sizes"][str(size)][kind]
            print(
                f"{size:>5} tokens {kind:>10}: whole {entry['whole']['median_ms']:.2f} ms, "
                f"kvgate {entry['kvgate']['median_ms']:.2f} ms"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenize_bench.json").write_text(json.dumps(with_source(results), indent=2))
    plot(results, out / "tokenize_bench.png")
    (out / "tokenize_bench.md").write_text(report(results))
    print(f"wrote {out / 'tokenize_bench.json'}, .md and .png")


def report(results: dict) -> str:
    lines = [
        "# Chat tokenization benchmark",
        "",
        f"Command: `{results['command']}` (real Qwen3 tokenizer and chat template; load average "
        f"{' '.join(results['machine']['load_average'])} on a shared 2-core machine). "
        "Median CPU time per request; "
        "every kvgate result equals the whole-prompt tokens.",
        "",
        "| prompt | turn | whole prompt (render + encode) | kvgate (per-message and segment cache) |",
        "|---|---|---|---|",
    ]
    for size, entry in results["sizes"].items():
        for kind in KINDS:
            lines.append(
                f"| ~{int(size) // 1024}k tokens (median {entry['prompt_tokens_median']}) | "
                f"{kind.replace('_', ' ')} | "
                f"{entry[kind]['whole']['median_ms']:.2f} ms | {entry[kind]['kvgate']['median_ms']:.2f} ms |"
            )
    lines += ["", "![tokenize benchmark](tokenize_bench.png)", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
