"""The vLLM connector's scheduler-side planning (no vLLM needed): hits, loads, saves, bookkeeping."""

from __future__ import annotations

import pytest

from cachelayer.connectors.planning import SchedulerPlanner, StepPlan

CHUNK, BLOCK = 256, 32


def planner() -> SchedulerPlanner:
    return SchedulerPlanner(chunk_size=CHUNK, block_size=BLOCK)


def store_holding(count: int):
    """A store that holds the first `count` tokens of any prompt; records the prefixes asked."""
    asked: list[int] = []

    def held(prefix) -> int:
        asked.append(len(prefix))
        return min(count, len(prefix))

    held.asked = asked  # type: ignore[attr-defined]
    return held


def blocks_for(num_tokens: int, first: int = 100) -> list[int]:
    return list(range(first, first + (num_tokens + BLOCK - 1) // BLOCK))


def whole_chunks_of(count: int):
    """A store holding the whole chunks of the first `count` tokens of any prompt (as a plain save
    leaves it); records the prefixes asked."""
    asked: list[int] = []

    def held(prefix) -> int:
        asked.append(len(prefix))
        return min(count, len(prefix)) // CHUNK * CHUNK

    held.asked = asked  # type: ignore[attr-defined]
    return held


def test_a_hit_is_whole_blocks_and_never_covers_the_last_prompt_token():
    held = store_holding(10_000)
    plan = planner()
    # The lookup asks for the whole blocks before the last token: 699 // 32 blocks.
    assert plan.matched_tokens("r", list(range(700)), 0, cacheable=True, held_tokens=held) == 672
    assert held.asked == [672]
    # Exactly two chunks long: the last token must be computed, so its last block is not loaded.
    assert plan.matched_tokens("r2", list(range(512)), 0, cacheable=True, held_tokens=held) == 480
    assert plan.matched_tokens("r3", list(range(32)), 0, cacheable=True, held_tokens=held) == 0
    assert held.asked == [672, 480]  # a one-block prompt has nothing to look up
    # A store holding whole chunks answers whole chunks: a plain prompt's hit is as before.
    chunks = whole_chunks_of(10_000)
    assert plan.matched_tokens("r4", list(range(700)), 0, cacheable=True, held_tokens=chunks) == 512


def test_the_engine_own_prefix_hit_is_subtracted():
    plan = planner()
    assert (
        plan.matched_tokens("r", list(range(1000)), 320, cacheable=True, held_tokens=store_holding(768))
        == 448
    )
    assert (
        plan.matched_tokens("r", list(range(1000)), 768, cacheable=True, held_tokens=store_holding(768)) == 0
    )


def test_uncacheable_requests_are_never_looked_up():
    held = store_holding(10_000)
    assert planner().matched_tokens("r", list(range(700)), 0, cacheable=False, held_tokens=held) == 0
    assert held.asked == []


def test_a_load_writes_only_blocks_past_the_engine_prefix_hit():
    plan = planner()
    prompt = list(range(700))
    plan.matched_tokens("r", prompt, 64, cacheable=True, held_tokens=store_holding(512))
    plan.allocated("r", prompt, "salt", blocks_for(700), 448, cacheable=True)
    step = StepPlan()
    plan.scheduled(
        "r", num_computed_tokens=512, num_scheduled_tokens=188, block_ids=blocks_for(700), plan=step
    )
    (load,) = step.loads
    assert load.token_ids == prompt[:512]
    assert load.block_ids == blocks_for(512)
    assert load.first_block == 2
    assert load.cache_salt == "salt"
    # Everything saveable (2 whole chunks) came from the store: nothing to save.
    assert step.saves == []


def test_a_consumer_loads_but_never_saves():
    plan = SchedulerPlanner(chunk_size=CHUNK, block_size=BLOCK, saves=False)
    prompt = list(range(900))
    assert plan.matched_tokens("r", prompt, 0, cacheable=True, held_tokens=store_holding(512)) == 512
    plan.allocated("r", prompt, None, blocks_for(900), 512, cacheable=True)
    step = StepPlan()
    plan.scheduled(
        "r", num_computed_tokens=512, num_scheduled_tokens=388, block_ids=blocks_for(900), plan=step
    )
    assert [load.token_ids for load in step.loads] == [prompt[:512]]
    assert step.saves == []  # a third chunk was computed here, and still not saved
    assert (plan.external_tokens("r"), plan.loaded_tokens("r")) == (512, 512)


def test_a_handoff_request_is_saved_as_a_handoff_and_others_are_not():
    plan = planner()
    prompt = list(range(600))
    for request_id, handoff in (("prefill", True), ("plain", False)):
        plan.matched_tokens(request_id, prompt, 0, cacheable=True, held_tokens=store_holding(0))
        plan.allocated(request_id, prompt, None, blocks_for(600), 0, cacheable=True, handoff=handoff)
    step = StepPlan()
    for request_id in ("prefill", "plain"):
        plan.scheduled(
            request_id, num_computed_tokens=0, num_scheduled_tokens=600, block_ids=blocks_for(600), plan=step
        )
    assert {save.request_id: save.handoff for save in step.saves} == {"prefill": True, "plain": False}
    assert plan.external_tokens("prefill") == 0
    # The handoff is saved up to the prefix its decode engine looks up, its tail chunk included
    # (599 // 32 blocks); the plain prompt as its whole chunks only.
    lengths = {save.request_id: len(save.token_ids) for save in step.saves}
    assert lengths == {"prefill": 576, "plain": 512}
    assert plan.lookup_limit(len(prompt)) == 576
    (handoff,) = (save for save in step.saves if save.handoff)
    assert handoff.block_ids == blocks_for(576)


def test_a_handoff_of_whole_chunks_keeps_its_last_chunk_whole():
    """Its lookup prefix (480 of 512 tokens) would leave the last chunk as a tail one block short,
    which no longer prompt could reuse: the save is the whole chunks, as a plain prompt's."""
    plan = planner()
    prompt = list(range(2 * CHUNK))
    plan.matched_tokens("prefill", prompt, 0, cacheable=True, held_tokens=store_holding(0))
    plan.allocated("prefill", prompt, None, blocks_for(2 * CHUNK), 0, cacheable=True, handoff=True)
    step = StepPlan()
    plan.scheduled(
        "prefill",
        num_computed_tokens=0,
        num_scheduled_tokens=2 * CHUNK,
        block_ids=blocks_for(2 * CHUNK),
        plan=step,
    )
    (save,) = step.saves
    assert save.handoff and save.token_ids == prompt


def test_a_prompt_is_saved_once_when_its_last_token_is_computed_even_with_chunked_prefill():
    plan = planner()
    prompt = list(range(900))
    plan.matched_tokens("r", prompt, 0, cacheable=True, held_tokens=store_holding(0))
    plan.allocated("r", prompt, None, blocks_for(512), 0, cacheable=True)

    first = StepPlan()
    plan.scheduled(
        "r", num_computed_tokens=0, num_scheduled_tokens=512, block_ids=blocks_for(512), plan=first
    )
    assert first.loads == [] and first.saves == []

    second = StepPlan()
    extra = blocks_for(900)[len(blocks_for(512)) :]
    plan.scheduled("r", num_computed_tokens=512, num_scheduled_tokens=388, new_block_ids=extra, plan=second)
    (save,) = second.saves
    assert save.token_ids == prompt[:768]  # 3 whole chunks; the 132-token tail is not shared
    assert save.block_ids == blocks_for(768)

    decode = StepPlan()
    plan.scheduled("r", num_computed_tokens=900, num_scheduled_tokens=1, plan=decode)
    assert decode.saves == [] and decode.loads == []


def test_a_resumed_request_replaces_its_blocks():
    plan = planner()
    prompt = list(range(600))
    plan.matched_tokens("r", prompt, 0, cacheable=True, held_tokens=store_holding(0))
    plan.allocated("r", prompt, None, blocks_for(256), 0, cacheable=True)
    plan.scheduled(
        "r", num_computed_tokens=0, num_scheduled_tokens=256, block_ids=blocks_for(256), plan=StepPlan()
    )
    resumed = StepPlan()
    plan.scheduled("r", num_computed_tokens=0, num_scheduled_tokens=600, block_ids=blocks_for(600, first=7),
                   plan=resumed)  # fmt: skip
    assert resumed.saves[0].block_ids == blocks_for(512, first=7)


def test_finished_requests_are_forgotten():
    plan = planner()
    plan.allocated("r", list(range(600)), None, blocks_for(600), 0, cacheable=True)
    assert plan.num_tracked == 1
    plan.finished("r")
    assert plan.num_tracked == 0
    step = StepPlan()
    plan.scheduled("r", num_computed_tokens=0, num_scheduled_tokens=600, plan=step)
    assert step.saves == []


def test_a_chunk_size_that_is_not_a_multiple_of_the_block_size_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"chunk_size 100 must be a multiple of vLLM's block size 32"):
        SchedulerPlanner(chunk_size=100, block_size=32)


def test_an_asynchronous_load_is_planned_in_the_step_that_allocated_it_though_not_scheduled():
    plan = planner()
    prompt = list(range(700))
    plan.matched_tokens("r", prompt, 0, cacheable=True, held_tokens=store_holding(512))
    plan.allocated("r", prompt, None, blocks_for(512), 512, cacheable=True)
    step = StepPlan()
    plan.take_pending_loads(step)  # the request waits off the batch: it is not scheduled
    (load,) = step.loads
    assert (load.token_ids, load.block_ids, load.first_block) == (prompt[:512], blocks_for(512), 0)
    again = StepPlan()
    plan.take_pending_loads(again)
    assert again.loads == []  # planned once
    # The load landed; vLLM allocates the rest and schedules the request with nothing to load.
    plan.load_result("r", 512)
    plan.allocated("r", prompt, None, blocks_for(700), 0, cacheable=True)
    later = StepPlan()
    plan.scheduled(
        "r", num_computed_tokens=512, num_scheduled_tokens=188, block_ids=blocks_for(700), plan=later
    )
    assert later.loads == [] and later.saves == []  # both chunks came from the store


def test_a_request_whose_load_failed_is_not_looked_up_again_and_its_prompt_is_saved():
    plan = planner()
    prompt = list(range(700))
    held = store_holding(512)  # the store still claims the prefix
    assert plan.matched_tokens("r", prompt, 0, cacheable=True, held_tokens=held) == 512
    plan.allocated("r", prompt, None, blocks_for(512), 512, cacheable=True)
    plan.take_pending_loads(StepPlan())
    plan.load_result("r", 0)  # nothing landed: vLLM frees the blocks and asks again
    assert plan.load_failed("r")
    assert plan.matched_tokens("r", prompt, 0, cacheable=True, held_tokens=held) == 0
    assert held.asked == [672]  # not asked again: the request is recomputed
    plan.allocated("r", prompt, None, blocks_for(700), 0, cacheable=True)
    step = StepPlan()
    plan.scheduled("r", num_computed_tokens=0, num_scheduled_tokens=700, block_ids=blocks_for(700), plan=step)
    assert step.loads == []
    assert [len(save.token_ids) for save in step.saves] == [512]  # the recomputed prompt is stored
