"""The benchmark workloads: seeded, tokenized like the engine, and shaped with the reuse they claim."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvgate_testing import workloads
from kvgate_testing.reference_placement import EngineBlockCache, reference_placement


@pytest.fixture(scope="module")
def tokenizer():
    return workloads.qwen3_tokenizer()


def _small(name: str, tokenizer, **overrides):
    sizes = {
        "chat_sessions": {"users": 4, "turns": 3, "system_tokens": 64},
        "shared_system_prompts": {"system_prompts": 3, "system_prompt_tokens": 200, "users": 8},
        "document_qa": {"documents": 3, "document_tokens": 300, "questions_per_document": 3},
        "no_reuse": {"requests": 12, "prompt_tokens": (50, 120)},
        "shared_tier_documents": {"documents": 4, "document_tokens": 300, "requests": 16},
        "cache_pressure": {"prefixes": 12, "prefix_tokens": 200, "requests": 48},
    }[name]
    return workloads.build(name, tokenizer, **{**sizes, **overrides})


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_same_seed_gives_the_same_requests_and_another_seed_does_not(name, tokenizer):
    first = _small(name, tokenizer)
    again = _small(name, tokenizer)
    other = _small(name, tokenizer, seed=99)
    assert [r.messages for r in first.requests] == [r.messages for r in again.requests]
    assert all(
        np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
        for a, b in zip(first.requests, again.requests, strict=True)
    )
    assert [r.arrival_s for r in first.requests] == [r.arrival_s for r in again.requests]
    assert [r.messages for r in first.requests] != [r.messages for r in other.requests]


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_prompt_ids_are_the_chat_template_tokenized_as_vllm_does(name, tokenizer):
    workload = _small(name, tokenizer)
    for request in workload.requests[:5]:
        rendered = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        assert rendered.endswith("<|im_start|>assistant\n")
        expected = tokenizer.encode(rendered, add_special_tokens=False)
        assert request.prompt_token_ids.dtype == np.uint32
        assert request.prompt_token_ids.tolist() == expected


@pytest.mark.parametrize("name", list(workloads.WORKLOADS))
def test_arrivals_are_open_loop_sorted_and_near_the_asked_rate(name, tokenizer):
    workload = _small(name, tokenizer, rate=50.0)
    arrivals = [r.arrival_s for r in workload.requests]
    assert arrivals[0] == 0.0
    assert arrivals == sorted(arrivals)
    assert [r.index for r in workload.requests] == list(range(len(workload.requests)))
    if name in ("shared_system_prompts", "no_reuse", "cache_pressure"):  # pure Poisson arrivals
        mean_gap = arrivals[-1] / (len(arrivals) - 1)
        assert 0.4 / 50.0 < mean_gap < 2.5 / 50.0


def test_pseudo_text_has_the_asked_token_length(tokenizer):
    maker = workloads._TextMaker(tokenizer)
    rng = np.random.default_rng(0)
    for tokens in (1, 17, 300, 2000):
        text = maker.text(rng, tokens)
        # Cutting at a token and decoding can merge the last two tokens when re-encoded.
        assert abs(len(tokenizer.encode(text, add_special_tokens=False)) - tokens) <= 1


def test_chat_turns_extend_the_previous_turns_prompt(tokenizer):
    workload = _small("chat_sessions", tokenizer)
    by_session: dict[str, list] = {}
    for request in workload.requests:
        by_session.setdefault(request.session_id, []).append(request)
    assert len(by_session) == 4
    for turns in by_session.values():
        assert len(turns) == 3
        assert [t.arrival_s for t in turns] == sorted(t.arrival_s for t in turns)
        for earlier, later in itertools.pairwise(turns):
            shared = len(earlier.prompt_token_ids)
            assert later.prompt_token_ids[:shared].tolist() == earlier.prompt_token_ids.tolist()


def test_users_of_one_system_prompt_share_its_blocks(tokenizer):
    workload = _small("shared_system_prompts", tokenizer, system_prompts=1, users=3, requests_per_user=1)
    first_blocks = [workloads.block_keys(r.prompt_token_ids, 16)[:12] for r in workload.requests]
    assert first_blocks[0] == first_blocks[1] == first_blocks[2]
    assert workload.requests[0].messages[1] != workload.requests[1].messages[1]


def test_questions_on_one_document_share_it_and_documents_differ(tokenizer):
    workload = _small("document_qa", tokenizer, documents=2, questions_per_document=2)
    by_reader: dict[str, list] = {}
    for request in workload.requests:
        by_reader.setdefault(request.session_id, []).append(request)
    readers = list(by_reader.values())
    same = [workloads.block_keys(r.prompt_token_ids, 16) for r in readers[0]]
    other = workloads.block_keys(readers[1][0].prompt_token_ids, 16)
    common = next(i for i, (a, b) in enumerate(zip(same[0], same[1], strict=False)) if a != b)
    assert common >= 300 // 16
    assert sum(a == b for a, b in zip(same[0], other, strict=False)) <= 2  # only the instruction block


def test_shared_tier_documents_are_reread_by_popularity_over_the_whole_run(tokenizer):
    workload = _small("shared_tier_documents", tokenizer, documents=6, requests=90, rate=30.0)
    document_blocks = 300 // 16
    by_document: dict[bytes, list] = {}
    for request in workload.requests:
        # The document's last full block names it (the instruction before it is the same for all).
        key = workloads.block_keys(request.prompt_token_ids, 16)[document_blocks]
        by_document.setdefault(key, []).append(request.arrival_s)
    assert len(by_document) == 6  # every document is read
    reads = sorted((len(arrivals), arrivals) for arrivals in by_document.values())
    # Skewed popularity: the most read document is read several times as often as the least read.
    assert reads[-1][0] >= 3 * reads[0][0]
    # Not in bursts: the popular documents' reads span most of the run, so between two reads the
    # engines serve other documents (and, with small GPU caches, evict this one).
    span = workload.requests[-1].arrival_s
    for _count, arrivals in reads[-2:]:
        assert max(arrivals) - min(arrivals) > span / 2
    # Readers are anonymous: no session ties reads of a document together.
    assert len({r.session_id for r in workload.requests}) == len(workload.requests)
    assert workload.summary()["unbounded_cache_hit_ratio"] > 0.7
    assert "shared_tier_documents" not in workloads.DEFAULT_WORKLOADS


def test_shared_tier_documents_refuse_fewer_reads_than_documents(tokenizer):
    with pytest.raises(ValueError, match=r"requests \(3\) must be at least documents \(4\)"):
        _small("shared_tier_documents", tokenizer, requests=3)


def test_cache_pressure_reuses_more_long_prefixes_than_the_fleet_holds_in_random_order(tokenizer):
    defaults = workloads.CachePressureParams()
    # The default run against the routing benchmark's default fleet (8 engines x 512 blocks of 16).
    assert defaults.prefixes * defaults.prefix_tokens >= 3 * 8 * 512 * 16
    workload = _small("cache_pressure", tokenizer, prefixes=12, prefix_tokens=200, requests=60)
    by_prefix: dict[str, list] = {}
    for request in workload.requests:
        by_prefix.setdefault(request.session_id, []).append(request)
    assert len(by_prefix) == 12
    uses = sorted(len(asks) for asks in by_prefix.values())
    assert uses[0] >= workload.params["min_uses"]
    assert uses[-1] > uses[0]  # popularity is skewed
    # A family's requests share the prefix's blocks; two families share at most the template's first.
    families = [[workloads.block_keys(r.prompt_token_ids, 16) for r in asks] for asks in by_prefix.values()]
    assert all(keys[0][: 200 // 16] == keys[-1][: 200 // 16] for keys in families)
    assert sum(a == b for a, b in zip(families[0][0], families[1][0], strict=False)) <= 1
    # Random order: consecutive requests mostly belong to different families.
    changes = sum(a.session_id != b.session_id for a, b in itertools.pairwise(workload.requests))
    assert changes >= 0.7 * (len(workload.requests) - 1)
    # Under pressure (the prefixes are 2.3x what 2 engines of 32 blocks hold) even the reference keeps far
    # less than an unbounded cache would.
    reference = reference_placement(workload, engines=2, num_gpu_blocks=32, block_size=16)
    assert reference.hit_ratio < 0.8 * workload.summary()["unbounded_cache_hit_ratio"]
    with pytest.raises(ValueError, match="lower min_uses or raise requests"):
        _small("cache_pressure", tokenizer, requests=20)


def test_no_reuse_control_has_nothing_to_reuse_and_the_others_do(tokenizer):
    assert _small("no_reuse", tokenizer).summary()["unbounded_cache_hit_ratio"] == 0.0
    for name in ("chat_sessions", "shared_system_prompts", "document_qa", "cache_pressure"):
        assert _small(name, tokenizer).summary()["unbounded_cache_hit_ratio"] > 0.3


def test_unknown_workload_or_parameter_is_refused_with_the_known_ones(tokenizer):
    with pytest.raises(ValueError, match=r"unknown workload 'chats'.*chat_sessions"):
        workloads.build("chats", tokenizer)
    with pytest.raises(ValueError, match=r"no parameter\(s\) \['userz'\].*'users'"):
        workloads.build("chat_sessions", tokenizer, userz=3)


def test_scale_multiplies_population_and_rate_and_rate_scale_the_rate_alone(tokenizer):
    defaults = workloads.NoReuseParams()
    scaled = workloads.build("no_reuse", tokenizer, scale=0.1, prompt_tokens=(20, 40))
    assert scaled.params["requests"] == len(scaled.requests) == round(defaults.requests * 0.1)
    assert scaled.params["rate"] == pytest.approx(defaults.rate * 0.1)
    faster = workloads.build("no_reuse", tokenizer, scale=0.1, rate_scale=4.0, prompt_tokens=(20, 40))
    assert len(faster.requests) == len(scaled.requests)
    assert faster.params["rate"] == pytest.approx(defaults.rate * 0.4)
    assert faster.requests[-1].arrival_s < scaled.requests[-1].arrival_s
    # The real tier's scale (2 engines for 8): cache_pressure keeps its pressure per engine.
    small = workloads.build("cache_pressure", tokenizer, scale=0.25, prefix_tokens=48, question_tokens=(4, 8))
    assert (small.params["prefixes"], small.params["requests"]) == (28, 168)
    assert len({r.session_id for r in small.requests}) == 28


# ---- the reference placement's engine model ----


def _keys(*blocks: int) -> list[bytes]:
    return [bytes([b]) for b in blocks]


def test_engine_block_cache_hits_full_blocks_and_always_computes_the_last_token():
    cache = EngineBlockCache(num_blocks=8, block_size=4)
    assert cache.serve(_keys(1, 2), prompt_tokens=8, max_tokens=0, request_tag=0) == 0
    # Same 8 tokens again: the last token is recomputed, so only the first block is a hit.
    assert cache.serve(_keys(1, 2), prompt_tokens=8, max_tokens=0, request_tag=1) == 4
    # A longer prompt over the same two blocks reuses both.
    assert cache.serve(_keys(1, 2, 3), prompt_tokens=13, max_tokens=0, request_tag=2) == 8


def test_engine_block_cache_evicts_least_recently_freed_and_prompts_lose_their_tail_first():
    cache = EngineBlockCache(num_blocks=4, block_size=4)
    cache.serve(_keys(1, 2), prompt_tokens=9, max_tokens=0, request_tag=0)  # 3 slots: 1, 2, tail
    # Needs 3 new slots: the never-used one, then the tail slot, then block 2 (freed before block 1).
    cache.serve(_keys(7, 8), prompt_tokens=9, max_tokens=0, request_tag=1)
    assert cache.longest_cached_prefix(_keys(1, 2)) == 1
    assert cache.longest_cached_prefix(_keys(7, 8)) == 2


def test_engine_block_cache_refuses_a_request_larger_than_the_pool():
    with pytest.raises(ValueError, match="raise --num-gpu-blocks"):
        EngineBlockCache(num_blocks=2, block_size=4).serve(_keys(1, 2), 9, 0, 0)


def test_reference_keeps_the_load_cap_and_beats_round_robin(tokenizer):
    workload = _small("shared_system_prompts", tokenizer, users=16)
    result = reference_placement(workload, engines=4, num_gpu_blocks=64, block_size=16)
    assert result.max_over_mean_load <= 1.3
    assert sum(result.requests_per_engine) == len(workload.requests)
    round_robin = [EngineBlockCache(64, 16) for _ in range(4)]
    cached = 0
    for i, request in enumerate(workload.requests):
        keys = workloads.block_keys(request.prompt_token_ids, 16)
        cached += round_robin[i % 4].serve(keys, request.prompt_tokens, request.max_tokens, i)
    assert result.hit_ratio > cached / result.prompt_tokens
    assert reference_placement(_small("no_reuse", tokenizer), 4, 64).hit_ratio == 0.0
