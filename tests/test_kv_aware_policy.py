"""kv_aware and approximate policies on a real prefix index: cost, tiers, load, hot-spot guard,
cold-prefix spreading, predictions, namespaces, decisions and metrics."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from kvgate_testing.index_oracle import WritableIndex
from kvgate_testing.policy_inputs import PROMPTS, backends, request, store
from kvwire import BlockRemoved, BlockStored
from router.backends import BackendState
from router.config import ApproximatePolicy, KVAwarePolicy
from router.index.keys import Namespace, prompt_prefix_keys
from router.index.store import PrefixIndex
from router.policies.approximate import Approximate
from router.policies.base import Choice, RouteRequest
from router.policies.capacity import CapacityModel
from router.policies.kv_aware import KVAware, Predictions


def route(policy, req: RouteRequest, candidates: list[BackendState]) -> Choice:
    choice = policy.choose(req, candidates)
    policy.on_routed(choice)
    return choice


def test_the_backend_holding_the_prefix_wins() -> None:
    index = WritableIndex()
    store(index, "b2", PROMPTS[0][:256])
    policy = KVAware(KVAwarePolicy(), index)
    req = request(PROMPTS[0])
    choice = route(policy, req, backends())
    assert choice.backend.name == "b2"
    assert choice.reason == "cache_hit"
    assert choice.cached_tokens == 256
    assert choice.prefill_tokens == 256
    assert choice.candidates["b2"]["by_tier"] == {"gpu": 256}


def test_gpu_hits_beat_cpu_hits_of_the_same_length() -> None:
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:256], medium="CPU")
    store(index, "b1", PROMPTS[0][:256], medium="GPU")
    policy = KVAware(KVAwarePolicy(), index)
    assert policy.choose(request(PROMPTS[0]), backends(2)).backend.name == "b1"
    # A longer CPU prefix still beats a short GPU one.
    store(index, "b0", PROMPTS[0][:512], medium="CPU")
    assert policy.choose(request(PROMPTS[0]), backends(2)).backend.name == "b0"


# A backend holding a prefix over several tiers: each token counts once, at the fastest tier holding
# it (a CPU copy of blocks also on the GPU saves nothing more). Layouts per backend: (medium, first
# token, end token) of what it announced; PROMPTS[0] has 512 tokens.
SPLIT_OVER_TIERS = {
    "cpu_copy_of_the_gpu_head_and_more": (
        [("GPU", 0, 256), ("CPU", 0, 512)],  # saves 256 + 0.8 * 256 = 460.8
        [("GPU", 0, 512)],  # saves 512
        "b1",
    ),
    "cpu_holds_only_the_tail": (
        [("GPU", 0, 256), ("CPU", 256, 512)],  # saves 256 + 0.8 * 256 = 460.8
        [("GPU", 0, 512)],
        "b1",
    ),
    "three_tiers_against_one": (
        [("GPU", 0, 128), ("CPU", 0, 256), ("DISK", 0, 512)],  # 128 + 0.8 * 128 + 0.5 * 256 = 358.4
        [("CPU", 0, 512)],  # 0.8 * 512 = 409.6
        "b1",
    ),
    "the_cpu_tail_outweighs_a_shorter_gpu_prefix": (
        [("GPU", 0, 256), ("CPU", 0, 512)],  # 460.8
        [("GPU", 0, 448)],  # 448: counting only the GPU part of b0 would pick b1
        "b0",
    ),
}


def _layout_saves(layout: list[tuple[str, int, int]]) -> float:
    """Weighted tokens a layout saves, each token at its fastest tier (KVAwarePolicy's defaults)."""
    config = KVAwarePolicy()
    weight = {"GPU": config.gpu_hit_weight, "CPU": config.cpu_hit_weight, "DISK": config.disk_hit_weight}
    saved = 0.0
    for position in range(len(PROMPTS[0])):
        holders = [medium for medium, start, end in layout if start <= position < end]
        saved += max((weight[medium] for medium in holders), default=0.0)
    return saved


@pytest.mark.parametrize("layouts", SPLIT_OVER_TIERS.values(), ids=SPLIT_OVER_TIERS.keys())
def test_a_prefix_split_over_two_tiers_counts_each_token_at_its_fastest_tier(layouts) -> None:
    """Against a backend holding the prefix in one tier, the split one's cost counts the slower tier
    only for the tokens past what the faster tiers hold (counting the whole CPU run again, as if the
    GPU head were not there, picked b0 holding 256 on GPU and 512 on CPU over b1 holding 512 on GPU)."""
    layout_b0, layout_b1, winner = layouts
    index = WritableIndex()
    for name, layout in (("b0", layout_b0), ("b1", layout_b1)):
        for medium, start, end in layout:
            store(index, name, PROMPTS[0][:end], medium=medium, start=start)
    policy = KVAware(KVAwarePolicy(), index)
    req = request(PROMPTS[0])
    choice = policy.choose(req, backends(2))
    assert choice.backend.name == winner
    uncached_weight = KVAwarePolicy().uncached_token_weight
    for name, layout in (("b0", layout_b0), ("b1", layout_b1)):
        candidate = choice.candidates[name]
        assert candidate["cost"] == pytest.approx(uncached_weight * (512 - _layout_saves(layout)))
        assert candidate["cached"] == max(end for _, _, end in layout)


def test_load_outweighs_a_small_cache_hit() -> None:
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:96])
    candidates = backends(2)
    candidates[0].in_flight = 2
    candidates[0].in_flight_prefill_tokens = 2000
    policy = KVAware(KVAwarePolicy(max_load_ratio=100), index)
    req = request(PROMPTS[0])
    choice = policy.choose(req, candidates)
    assert choice.backend.name == "b1"
    assert choice.reason == "least_load"


def test_in_flight_guard_moves_a_hot_prefix_but_leaves_a_conversation_home() -> None:
    """The in-flight line skips an overloaded holder of a hot prefix (the next requests share the
    replica it makes), not the holder of a prefix one conversation uses: moving that pays its whole
    prefill again, and the cost's load terms already weigh the holder's queue."""
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:480])
    candidates = backends(4)
    candidates[0].in_flight = 4  # over 1.25 x mean (1) + 2; the cost still favours b0 (32 tokens to compute)
    # replica_must_pay off: the line alone (with it, 3 uses of a 512-token prefix do not pay a copy:
    # the next test).
    policy = KVAware(KVAwarePolicy(max_share_ratio=100, share_noise=0, replica_must_pay=False), index)
    for turn in range(4):
        own = request(PROMPTS[0], rid=f"turn-{turn}")
        own_choice = route(policy, own, candidates)
        assert own_choice.backend.name == "b0"
        assert own_choice.reason == "cache_hit"
    # The first matched 480 tokens (the index), the next ones all 512 (predicted after the first).
    # Uses decay (share_half_life_s), so two read just under 2; with three the prefix is hot
    # (hot_prefix_requests 2) and the guard applies.
    hot = request(PROMPTS[0], rid="another-user")
    hot_choice = route(policy, hot, candidates)
    assert hot_choice.backend.name != "b0"
    assert hot_choice.reason == "load_guard"


def test_with_replica_must_pay_a_hot_prefix_moves_only_once_its_uses_outweigh_the_copy() -> None:
    """replica_must_pay (the default): the guard copies a hot prefix to another engine only when its recent
    requests, at request_load_weight prompt tokens each, outweigh the prefill the copy costs (the
    512 tokens held here): a document's few questions stay with it, a much-shared prefix moves."""
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:480])
    candidates = backends(4)
    candidates[0].in_flight = 4  # over the in-flight line, as above
    policy = KVAware(KVAwarePolicy(max_share_ratio=100, share_noise=0, request_load_weight=100), index)
    homes, reasons = [], []
    for n in range(8):
        req = request(PROMPTS[0], rid=f"user-{n}")
        choice = route(policy, req, candidates)
        homes.append(choice.backend.name)
        reasons.append(choice.reason)
    # Uses of the 512-token prefix before each request: 0, 0 (the 480 one was matched first), 1, 2,
    # ... 6; each just under its count (decay). Hot from the 3rd (hot_prefix_requests 2), but
    # 100 x uses stays under 512 through 5 uses.
    assert homes[:7] == ["b0"] * 7 and reasons[:7] == ["cache_hit"] * 7
    assert homes[7] != "b0" and reasons[7] == "load_guard"
    # Without the check, the same prefix moves as soon as it is hot (see the test above).
    eager_config = KVAwarePolicy(max_share_ratio=100, share_noise=0, request_load_weight=100)
    eager = KVAware(msgspec.structs.replace(eager_config, replica_must_pay=False), index)
    eager_homes = [
        route(eager, request(PROMPTS[0], rid=f"eager-{n}"), candidates).backend.name for n in range(5)
    ]
    assert eager_homes[:4] == ["b0"] * 4 and eager_homes[4] != "b0"


def test_cold_prefixes_arriving_one_at_a_time_spread_over_all_engines() -> None:
    policy = KVAware(KVAwarePolicy(), WritableIndex())
    candidates = backends(4)
    first = [route(policy, request(PROMPTS[n], rid=f"r{n}"), candidates).backend.name for n in range(8)]
    assert sorted(first) == ["b0", "b0", "b1", "b1", "b2", "b2", "b3", "b3"]
    # The same prompts again (their events not arrived yet): predictions send each back home.
    again = [route(policy, request(PROMPTS[n]), candidates).backend.name for n in range(8)]
    assert again == first


@pytest.mark.parametrize("cold_spread_by", ["new_prefixes", "prefill_tokens"])
def test_a_cold_prompt_goes_where_recent_prefills_are_fewest_when_spread_by_prefill_tokens(
    cold_spread_by: str,
) -> None:
    policy = KVAware(KVAwarePolicy(cold_spread_by=cold_spread_by), WritableIndex())
    candidates = backends(2)
    busy = route(policy, request(PROMPTS[0][:128], rid="conversation-a"), candidates).backend.name
    quiet = route(policy, request(PROMPTS[1][:128], rid="conversation-b"), candidates).backend.name
    assert busy != quiet
    # Conversation a's next turn stays home (its first turn is predicted there) and adds 384
    # tokens of prefill to that engine; b has no follow-up.
    assert route(policy, request(PROMPTS[0], rid="conversation-a-2"), candidates).backend.name == busy
    newcomer = request(PROMPTS[2][:128], rid="conversation-c")
    newcomer_choice = route(policy, newcomer, candidates)
    placed = newcomer_choice.backend.name
    assert newcomer_choice.reason == "cold_spread"
    # By new prefixes the two engines tie (one each) and the turn decides; by prefill tokens the
    # engine whose cache took less lately gets the new conversation.
    assert placed == (quiet if cold_spread_by == "prefill_tokens" else busy)


@pytest.mark.parametrize("still_prefilling", [True, False])
def test_a_cold_prompt_takes_the_in_flight_slack_only_past_the_other_prefills(still_prefilling: bool) -> None:
    policy = KVAware(KVAwarePolicy(), WritableIndex())
    candidates = backends(2)
    # b1 took the last cold prompt (its 500 tokens); b0 has had none lately but has a request in flight.
    policy.cold_spread.add("b1", 500.0, time.monotonic())
    candidates[0].in_flight = 1
    candidates[0].in_flight_prefill_tokens = 500 if still_prefilling else 0
    req = request(PROMPTS[3])
    choice = policy.choose(req, candidates)
    chosen = choice.backend.name
    assert choice.reason == "cold_spread"
    # Decoding, b0's request delays a new prefill little: the fewer cold placements win. Still
    # prefilling, it would make the new prompt wait for all of its prefill: the idle engine wins.
    assert chosen == ("b1" if still_prefilling else "b0")


def test_predictions_expire_and_never_reach_the_index() -> None:
    index = WritableIndex()
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=0.2), index)
    candidates = backends(2)
    home = route(policy, request(PROMPTS[0]), candidates).backend.name
    assert index.longest_cached_prefix(PROMPTS[0])  == {}  # fmt: skip
    req = request(PROMPTS[0])
    choice = policy.choose(req, candidates)
    assert choice.candidates[home]["predicted"] == 512
    time.sleep(0.3)
    req = request(PROMPTS[0])
    choice = policy.choose(req, candidates)
    assert choice.candidates[home]["predicted"] == 0


def test_predictions_hold_each_credit_for_its_ttl_across_generations() -> None:
    predictions = Predictions(ttl_s=10.0)
    keys = [11, 12, 13, 14]
    predictions.add("a", keys, now=100.0)
    predictions.add("a", keys[:2], now=108.0)  # a shorter prompt sharing two blocks, later
    predictions.add("b", keys[:3], now=100.0, ttl_s=2.0)  # a peer's credit with a shorter ttl
    assert predictions.leading_blocks("a", keys, 105.0) == 4
    assert predictions.leading_blocks("b", keys, 101.0) == 3
    assert predictions.leading_blocks("b", keys, 102.5) == 0
    predictions.expire(111.0)  # a new generation starts: the credits of 100 and 108 are still read
    assert predictions.leading_blocks("a", keys, 109.0) == 4
    assert predictions.leading_blocks("a", keys, 111.0) == 2  # the whole prompt's credit lapsed at 110
    predictions.add("a", [11, 99], now=115.0)  # re-credited in the newer generation
    predictions.expire(122.0)  # the generation of 100-110 is dropped; 108's credit lapsed at 118
    assert predictions.leading_blocks("a", keys, 122.0) == 1  # 11, credited at 115 until 125
    assert predictions.leading_blocks("a", [11, 99, 5], 124.9) == 2
    assert predictions.leading_blocks("a", keys, 125.0) == 0
    predictions.forget("a")
    assert predictions.leading_blocks("a", [11, 99], 116.0) == 0


def test_predictions_are_bounded_per_backend_and_keep_the_latest_credits() -> None:
    predictions = Predictions(ttl_s=60.0, max_keys_per_backend=1000)
    prompts = [[prompt * 10_000 + block for block in range(300)] for prompt in range(40)]
    for at, keys in enumerate(prompts):  # 12000 distinct keys within the ttl
        predictions.add("a", keys, now=100.0 + at / 100)
    predictions.add("b", prompts[0][:10], now=100.0)
    newer, older = predictions._newer["a"], predictions._older["a"]
    assert len(newer) < 1000 and len(older) <= 1000 + 300
    # The latest prompts keep their whole credit; the earliest ones lost theirs early.
    assert predictions.leading_blocks("a", prompts[-1], 101.0) == 300
    assert predictions.leading_blocks("a", prompts[-2], 101.0) == 300
    assert predictions.leading_blocks("a", prompts[0], 101.0) == 0
    # Another backend's credit is its own to bound.
    assert predictions.leading_blocks("b", prompts[0], 101.0) == 10


def test_a_routed_prompt_is_predicted_past_what_its_engine_showed_and_no_further_back() -> None:
    index = WritableIndex()
    store(index, "b1", PROMPTS[0][:256])  # b1's events show the first 16 blocks
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=60), index)
    candidates = backends(2)
    first = request(PROMPTS[0])
    assert route(policy, first, candidates).backend.name == "b1"
    # Credited: the 16 blocks after the 16 the index holds (not the whole prompt again).
    assert sorted(policy.predictions._newer["b1"]) == sorted(prompt_prefix_keys(PROMPTS[0])[16:])
    again = request(PROMPTS[0])
    again_choice = policy.choose(again, candidates)
    assert again_choice.candidates["b1"]["cached"] == 512  # the index's 256 and the predicted 256
    assert again_choice.candidates["b1"]["predicted"] == 512
    # The engine evicted the first blocks: the prediction does not stand in for them.
    index.apply("b1", [BlockRemoved(block_hashes=list(range(1, 17)))])
    evicted = request(PROMPTS[0])
    evicted_choice = policy.choose(evicted, candidates)
    assert evicted_choice.candidates["b1"]["cached"] == 0
    # A prompt on an engine that shows none of it is credited whole.
    other = request(PROMPTS[1])
    chosen = route(policy, other, candidates).backend
    assert (
        policy.predictions.leading_blocks(chosen.name, prompt_prefix_keys(PROMPTS[1]), time.monotonic()) == 32
    )


def test_a_prefix_credited_lately_is_not_credited_again() -> None:
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=60), WritableIndex())
    candidates = backends(2)
    home = route(policy, request(PROMPTS[0]), candidates).backend.name
    keys = prompt_prefix_keys(PROMPTS[0])
    credited = dict(policy.predictions._newer[home])
    assert sorted(credited) == sorted(keys)
    # The same conversation, one turn longer: only its new blocks are credited; the earlier ones
    # keep their credit (over half of the ttl left) rather than being written again.
    longer = np.concatenate([PROMPTS[0], PROMPTS[1][:160]])
    follow_up = request(longer)
    assert route(policy, follow_up, candidates).backend.name == home
    table = policy.predictions._newer[home]
    assert all(table[key] == credited[key] for key in keys)
    new_keys = prompt_prefix_keys(longer)[len(keys) :]
    assert len(new_keys) == 10 and all(table[key] > credited[keys[0]] for key in new_keys)
    assert policy.predictions.leading_blocks(home, prompt_prefix_keys(longer), time.monotonic()) == 42


def test_two_choices_for_one_request_each_credit_their_own_backend() -> None:
    """A request chosen for twice before either is routed (a prefill engine and a decode engine):
    each Choice carries its own record, so each routing credits the prompt to its own backend."""
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=60), PrefixIndex())
    prefill_engine, decode_engine = backends(2)
    req = request(PROMPTS[0])
    prefill = policy.choose(req, [prefill_engine])
    decode = policy.choose(req, [decode_engine])
    policy.on_routed(prefill)
    policy.on_routed(decode)
    keys = prompt_prefix_keys(PROMPTS[0])
    now = time.monotonic()
    assert policy.predictions.leading_blocks("b0", keys, now) == len(keys)
    assert policy.predictions.leading_blocks("b1", keys, now) == len(keys)
    assert [d["backend"] for d in policy.recent_decisions()] == ["b0", "b1"]


def test_salted_requests_ignore_unsalted_entries() -> None:
    index = WritableIndex()
    store(index, "b1", PROMPTS[0])
    store(index, "b2", PROMPTS[0], salt="tenant-a")
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=0), index)
    assert policy.choose(request(PROMPTS[0]), backends()).backend.name == "b1"
    assert policy.choose(request(PROMPTS[0], salt="tenant-a"), backends()).backend.name == "b2"
    req = request(PROMPTS[0], salt="tenant-b")
    choice = policy.choose(req, backends())
    assert choice.cached_tokens == 0


def test_without_tokens_it_routes_by_load() -> None:
    policy = KVAware(KVAwarePolicy(), WritableIndex())
    candidates = backends(3)
    candidates[0].in_flight = 1
    candidates[1].in_flight = 1
    req = request(None)
    choice = policy.choose(req, candidates)
    assert choice.backend.name == "b2"
    assert choice.reason == "no_tokens"


def test_decisions_are_counted_and_kept_for_the_debug_page() -> None:
    registry = CollectorRegistry()
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:128])
    policy = KVAware(KVAwarePolicy(), index, registry)
    route(policy, request(PROMPTS[0], rid="hit"), backends(2))
    route(policy, request(PROMPTS[1], rid="cold"), backends(2))
    assert (
        registry.get_sample_value(
            "kvgate_route_decisions_total", {"policy": "kv_aware", "reason": "cache_hit"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "kvgate_routed_prompt_tokens_total", {"policy": "kv_aware", "kind": "cached"}
        )
        == 128
    )
    assert (
        registry.get_sample_value(
            "kvgate_routed_prompt_tokens_total", {"policy": "kv_aware", "kind": "prompt"}
        )
        == 1024
    )
    assert [d["request_id"] for d in policy.recent_decisions()] == ["hit", "cold"]
    assert policy.recent_decisions()[0]["cached_tokens"] == 128


def test_approximate_learns_from_routed_prompts() -> None:
    policy = Approximate(ApproximatePolicy())
    candidates = backends(3)
    homes = [route(policy, request(PROMPTS[n]), candidates).backend.name for n in range(3)]
    assert sorted(homes) == ["b0", "b1", "b2"]
    shared_prefix = np.concatenate([PROMPTS[1][:256], PROMPTS[9][:256]])
    req = request(shared_prefix)
    choice = route(policy, req, candidates)
    assert choice.backend.name == homes[1]
    assert choice.reason == "learned_hit" and choice.cached_tokens == 256


def test_approximate_memory_is_bounded_with_lru_eviction() -> None:
    policy = Approximate(ApproximatePolicy(max_tokens=2048, block_size=32))
    candidates = backends(2)
    for n in range(10):
        route(policy, request(PROMPTS[n]), candidates)
    assert policy.learned_size == 2048 // 32
    # The oldest prompts are forgotten, the newest remembered.
    assert policy.learned_blocks("b0", policy._block_keys(request(PROMPTS[0]))) == 0
    newest = request(PROMPTS[9])
    newest_choice = policy.choose(newest, candidates)
    assert newest_choice.cached_tokens == 512


def test_approximate_rejects_a_block_size_the_router_cannot_use() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        Approximate(ApproximatePolicy(block_size=24))


def test_a_request_for_a_lora_adapter_matches_that_adapters_entries() -> None:
    index = WritableIndex()
    store(index, "b1", PROMPTS[0])
    index.apply(
        "b2",
        [
            BlockStored(
                block_hashes=list(range(1, 33)),
                token_ids=PROMPTS[0].tolist(),
                block_size=16,
                lora_name="sql-adapter",
                extra_keys=[["sql-adapter"]],
            )
        ],
    )
    policy = KVAware(KVAwarePolicy(prediction_ttl_s=0), index)
    base = RouteRequest(request_id="base", model="m", body={}, tokens=PROMPTS[0], namespace=Namespace())
    assert policy.choose(base, backends()).backend.name == "b1"
    adapter = RouteRequest(
        request_id="lora",
        model="sql-adapter",
        body={},
        tokens=PROMPTS[0],
    )
    adapter_choice = policy.choose(adapter, backends())
    assert adapter_choice.backend.name == "b2"
    assert adapter_choice.cached_tokens == 512


def _family_prompt(prefix: np.ndarray, n: int) -> np.ndarray:
    tail = np.random.default_rng(1000 + n).integers(0, 150_000, size=128).astype(np.uint32)
    return np.concatenate([prefix, tail])


def test_a_hot_prefix_family_spills_to_a_second_engine_and_load_stays_balanced() -> None:
    # Requests finish at once (in flight stays 0): only the share guard can see the hot spot.
    policy = KVAware(KVAwarePolicy(), WritableIndex())
    candidates = backends(4)
    hot_prefix = PROMPTS[0][:384]
    counts: dict[str, int] = {}
    hot_homes: list[str] = []
    hot_hits = 0
    for n in range(80):
        hot = n % 2 == 0
        tokens = _family_prompt(hot_prefix, n) if hot else _family_prompt(PROMPTS[1 + n % 15][:0], n)
        req = request(tokens, rid=f"r{n}")
        choice = route(policy, req, candidates)
        chosen = choice.backend.name
        counts[chosen] = counts.get(chosen, 0) + 1
        if hot:
            hot_homes.append(chosen)
            hot_hits += choice.cached_tokens >= 384
    assert max(counts.values()) / (80 / 4) <= 1.3
    # Half the traffic is one family: one engine cannot take it, a second replica does...
    assert 2 <= len(set(hot_homes)) <= 3
    # ...and the family keeps its cache hits (all but the first request on each replica).
    assert hot_hits >= len(hot_homes) - len(set(hot_homes))


def test_a_burst_of_cold_prompts_spreads_evenly() -> None:
    policy = KVAware(KVAwarePolicy(), WritableIndex())
    candidates = backends(4)
    chosen = [
        route(policy, request(_family_prompt(PROMPTS[0][:0], n)), candidates).backend.name for n in range(40)
    ]
    assert {name: chosen.count(name) for name in set(chosen)} == {f"b{i}": 10 for i in range(4)}


def test_nothing_cached_deals_new_prefixes_out_among_the_least_loaded() -> None:
    # Counted by new prefixes (prompts of unequal lengths here; by prefill tokens see the test above).
    policy = KVAware(KVAwarePolicy(cold_spread_by="new_prefixes"), WritableIndex())
    candidates = backends(4)
    for backend, in_flight in zip(candidates, [8, 1, 2, 1], strict=True):
        backend.in_flight = in_flight  # every request past its prefill: no prefill queued anywhere
    req = request(PROMPTS[2])
    # No cold placements yet: fewest in flight (b1 or b3).
    choice = route(policy, req, candidates)
    first = choice.backend.name
    assert first in {"b1", "b3"}
    assert choice.reason == "cold_spread"
    # Then the fewest recent cold placements among those under the in-flight line (1.25 * mean 3
    # + 2 = 5.75: b2 with 2 in flight, never b0 with 8), the fewest in flight first between equals.
    picks = [
        route(policy, request(_family_prompt(PROMPTS[0][:0], n)), candidates).backend.name for n in range(5)
    ]
    assert picks[0] == ({"b1", "b3"} - {first}).pop()
    assert picks[1] == "b2" and "b0" not in picks
    assert sorted(picks[2:]) == ["b1", "b2", "b3"]


@pytest.mark.parametrize("busy, other", [(1, 0), (3, 1)])
def test_an_engine_busy_at_the_instant_still_gets_its_share_of_new_conversations(busy, other) -> None:
    """Two engines, new conversations one at a time while earlier ones run: the one engine with
    more requests decoding at that instant must not be skipped every time (it would get 5 of 12).
    (3 against 1 is what 2 real engines showed at the simulated tier's request rate.)"""
    policy = KVAware(KVAwarePolicy(), WritableIndex())
    candidates = backends(2)
    homes = []
    for n in range(12):
        # The engine with fewer conversations so far happens to have more requests running.
        fewer = min(candidates, key=lambda b: (homes.count(b.name), b.name))
        for backend in candidates:
            backend.in_flight = busy if backend is fewer else other
        homes.append(route(policy, request(_family_prompt(PROMPTS[0][:0], n)), candidates).backend.name)
    assert sorted(homes.count(name) for name in ("b0", "b1")) == [6, 6]


def test_cached_work_still_wins_under_light_balanced_load() -> None:
    index = WritableIndex()
    policy = KVAware(KVAwarePolicy(), index)
    candidates = backends(4)
    for n in range(8):  # two cold requests each: shares balanced
        route(policy, request(_family_prompt(PROMPTS[0][:0], n)), candidates)
    store(index, "b2", PROMPTS[5])
    req = request(PROMPTS[5])
    choice = route(policy, req, candidates)
    assert choice.backend.name == "b2"
    assert choice.reason == "cache_hit"


def test_a_conversation_of_its_own_stays_home_even_when_home_is_over_its_share() -> None:
    index = WritableIndex()
    policy = KVAware(KVAwarePolicy(hot_prefix_requests=2), index)
    candidates = backends(4)
    for n in range(12):  # b0 took far more than its share of recent requests
        policy.request_shares.add("b0" if n < 9 else f"b{n - 8}", 1.0, time.monotonic())
    store(index, "b0", PROMPTS[7])  # one conversation's history, cached on b0 only
    req = request(np.concatenate([PROMPTS[7], PROMPTS[8][:64]]))
    choice = route(policy, req, candidates)
    assert choice.backend.name == "b0"
    assert choice.reason == "cache_hit"
    # Held to the share line when every request is (hot_prefix_requests=0), it moves.
    strict = KVAware(KVAwarePolicy(hot_prefix_requests=0), index)
    strict.request_shares = policy.request_shares
    assert (
        strict.choose(request(np.concatenate([PROMPTS[7], PROMPTS[8][:64]])), candidates).backend.name != "b0"
    )


def test_a_spilled_prefix_goes_to_the_engine_with_most_headroom_and_the_next_spill_follows() -> None:
    index = WritableIndex()
    store(index, "b0", PROMPTS[0][:384])
    policy = KVAware(KVAwarePolicy(hot_prefix_requests=0), index)
    candidates = backends(3)
    now = time.monotonic()
    # b0 (holds the prefix) is over its share; b1 is under the line but busy with other traffic
    # (cache hits: nothing in flight right now); b2 has little recent traffic, one request in flight.
    for name, share in (("b0", 12), ("b1", 9), ("b2", 2)):
        policy.request_shares.add(name, share, now)
    candidates[2].in_flight = 1
    first = request(_family_prompt(PROMPTS[0][:384], 1), rid="spill-1")
    first_choice = route(policy, first, candidates)
    assert first_choice.backend.name == "b2"
    assert first_choice.reason == "load_guard"
    # The next request of the prefix finds it predicted on b2 and follows it there.
    second = request(_family_prompt(PROMPTS[0][:384], 2), rid="spill-2")
    second_choice = route(policy, second, candidates)
    assert second_choice.backend.name == "b2"
    assert second_choice.cached_tokens >= 384


def _document_questions(policy: KVAware) -> list[str]:
    """A document's six questions in a quick burst on two engines, the other engine having had one
    recent request: where each question goes (answers finish at once)."""
    index = policy.kv_index
    document = PROMPTS[2][:384]
    store(index, "b0", document)
    candidates = backends(2)
    policy.request_shares.add("b1", 1.0, time.monotonic())
    questions = [request(_family_prompt(document, n), rid=f"q{n}") for n in range(6)]
    return [route(policy, question, candidates).backend.name for question in questions]


def test_a_few_requests_against_one_are_chance_not_a_hot_spot() -> None:
    # 5 against 1 on two engines is within the chance spread of such small counts: the document
    # stays home instead of being computed again on the other engine.
    assert _document_questions(KVAware(KVAwarePolicy(), WritableIndex())) == ["b0"] * 6
    # A proportional line alone (share_noise 0) spills at the fifth question.
    spilled = _document_questions(KVAware(KVAwarePolicy(share_noise=0), WritableIndex()))
    assert spilled[:4] == ["b0"] * 4 and "b1" in spilled[4:]


def test_a_shared_header_alone_does_not_draw_cold_prompts_to_one_engine() -> None:
    # Every prompt starts with the same 16-token header (a chat template's), cached on b0 only:
    # new documents are spread as cold ones, not all sent to b0 for 16 cached tokens.
    index = WritableIndex()
    header = PROMPTS[3][:16]
    store(index, "b0", header)
    policy = KVAware(KVAwarePolicy(), index)
    candidates = backends(4)
    homes = []
    for n in range(4):
        req = request(np.concatenate([header, PROMPTS[4 + n]]), rid=f"doc{n}")
        choice = route(policy, req, candidates)
        homes.append(choice.backend.name)
        assert choice.reason == "cold_spread"
    assert sorted(homes) == ["b0", "b1", "b2", "b3"]
    # With the threshold at 0 the header is a hit: documents go to b0 until the share guard stops it.
    drawn = KVAware(KVAwarePolicy(affinity_min_tokens=0), index)
    documents = [request(np.concatenate([header, PROMPTS[4 + n]])) for n in range(2)]
    assert [route(drawn, document, candidates).backend.name for document in documents] == ["b0", "b0"]


def shared_tier_fleet(in_flight: list[int]) -> list[BackendState]:
    fleet = backends(len(in_flight))
    for backend, count in zip(fleet, in_flight, strict=True):
        backend.in_flight = count
    return fleet


def test_a_prefix_held_only_in_a_shared_tier_is_a_hit_for_every_attached_backend_and_load_picks() -> None:
    from router.config import SharedTier
    from router.policies.shared_tiers import SharedTiers

    index = WritableIndex()
    # b0 stored the prompt into the Redis tier that b0, b1 and b2 read; b3 is not attached.
    store(index, "b0", PROMPTS[0], medium="REMOTE")
    fleet = shared_tier_fleet([2, 0, 1, 0])
    tiers = SharedTiers([SharedTier(name="remote", backends=["b0", "b1", "b2"], hit_weight=0.6)])

    unaware = KVAware(KVAwarePolicy(), index)
    assert (
        unaware.choose(request(PROMPTS[0]), fleet).backend.name == "b0"
    )  # pinned to the engine that stored it

    aware = KVAware(KVAwarePolicy(), index, shared_tiers=tiers)
    req = request(PROMPTS[0])
    choice = aware.choose(req, fleet)
    assert choice.backend.name == "b1"  # the least loaded of those that can load it
    candidates = choice.candidates
    assert candidates["b1"]["by_tier"] == {"remote": 512} and candidates["b2"]["cached"] == 512
    assert candidates["b3"]["cached"] == 0
    # Weighted as a load from that tier (0.6 a token), not as a GPU hit (1.0 a token).
    assert candidates["b1"]["cost"] == pytest.approx(KVAwarePolicy().uncached_token_weight * 512 * 0.4)


def test_an_own_gpu_hit_beats_the_same_prefix_in_the_shared_tier() -> None:
    from router.config import SharedTier
    from router.policies.shared_tiers import SharedTiers

    index = WritableIndex()
    store(index, "b0", PROMPTS[1], medium="REMOTE")
    store(index, "b2", PROMPTS[1], medium="GPU")
    tiers = SharedTiers([SharedTier(name="remote", backends=["b0", "b1", "b2"])])
    policy = KVAware(KVAwarePolicy(), index, shared_tiers=tiers)
    req = request(PROMPTS[1])
    choice = policy.choose(req, shared_tier_fleet([0, 0, 0]))
    assert choice.backend.name == "b2"
    assert choice.candidates["b2"]["cost"] < choice.candidates["b1"]["cost"]


def test_a_shared_tier_stored_by_a_backend_that_is_not_a_candidate_still_counts() -> None:
    from router.config import SharedTier
    from router.policies.shared_tiers import SharedTiers

    index = WritableIndex()
    store(index, "b0", PROMPTS[2], medium="SHARED")  # the daemon's store, reported by b0
    tiers = SharedTiers([SharedTier(name="shared", backends=["b0", "b1", "b2", "b3"])])
    policy = KVAware(KVAwarePolicy(), index, shared_tiers=tiers)
    req = request(PROMPTS[2])
    fleet = shared_tier_fleet([0, 3, 1, 2])[1:]  # b0 is down
    choice = policy.choose(req, fleet)
    assert choice.backend.name == "b2"
    assert choice.cached_tokens == 512


# ---- cache pressure: capacity and survival (router/policies/capacity.py) ----


def _pressure_fleet(blocks: int = 32):
    from kvgate_testing.sim_pool import PoolEngine

    index = WritableIndex()
    engines = {name: PoolEngine(index, name, num_blocks=blocks) for name in ("b0", "b1")}
    return index, engines, {b.name: b for b in backends(2)}


def _pressure_policy(index: PrefixIndex, **config) -> KVAware:
    policy = KVAware(KVAwarePolicy(**config), index)
    if policy.capacity is not None:
        policy.capacity.check_interval_s = 0.0  # the index's counters read at every decision
    return policy


def _fake_clock(monkeypatch) -> list[float]:
    """kv_aware's monotonic clock, set by the test (clock[0])."""
    import types

    from router.policies import kv_aware as kv_aware_module

    clock = [1000.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0], time=time.time)
    monkeypatch.setattr(kv_aware_module, "time", fake_time)
    return clock


def _route_to(policy, engine, backend: BackendState, tokens: np.ndarray) -> RouteRequest:
    """Route a prompt where the test says (the only candidate) and run it on that engine."""
    req = request(tokens)
    choice = route(policy, req, [backend])
    assert choice.backend is backend
    engine.serve(tokens)
    policy.on_finished(choice, 200, None)
    return req


def test_under_pressure_an_evicted_prefix_comes_back_where_it_does_not_evict_a_hot_one(monkeypatch) -> None:
    clock = _fake_clock(monkeypatch)
    index, engines, by_name = _pressure_fleet()
    policy = _pressure_policy(index)
    gen = np.random.default_rng(4)
    document = gen.integers(0, 150_000, size=320).astype(np.uint32)
    hot = gen.integers(0, 150_000, size=320).astype(np.uint32)
    _route_to(policy, engines["b0"], by_name["b0"], document)
    # Then b0 serves a hot prefix: one store, then hits; it computes little but touches ~4200 tokens,
    # and its 32 blocks no longer hold the document.
    for _ in range(11):
        clock[0] += 1.0
        suffix = gen.integers(0, 150_000, size=32).astype(np.uint32)
        _route_to(policy, engines["b0"], by_name["b0"], np.concatenate([hot, suffix]))
    # b1 computed three one-off prompts: more prefill tokens than b0, a third of its tokens touched.
    for _ in range(3):
        _route_to(policy, engines["b1"], by_name["b1"], gen.integers(0, 150_000, size=400).astype(np.uint32))
    assert all(index.stats(name).removed_events for name in ("b0", "b1"))  # both full: they evict
    clock[0] += 5.0  # the document's prediction has lapsed: only the index speaks
    question = np.concatenate([document, gen.integers(0, 150_000, size=32).astype(np.uint32)])
    assert max(m.tokens for m in index.longest_cached_prefix(question).values()) == 0

    req = request(question)
    choice = route(policy, req, list(by_name.values()))
    chosen = choice.backend
    assert choice.reason == "cold_spread"
    # Where it goes decides what it evicts: on b0 its 22 blocks would push out most of the hot prefix.
    assert chosen.name == "b1"
    engines[chosen.name].serve(question)
    follow_up = np.concatenate([hot, gen.integers(0, 150_000, size=32).astype(np.uint32)])
    assert engines["b0"].serve(follow_up) == 320


def test_under_pressure_a_new_prompt_spreads_by_prefill_tokens_per_token_of_capacity() -> None:
    from kvgate_testing.sim_pool import PoolEngine

    index = WritableIndex()
    small, large = PoolEngine(index, "b0", num_blocks=32), PoolEngine(index, "b1", num_blocks=96)
    candidates = backends(2)
    policy = _pressure_policy(index)
    gen = np.random.default_rng(6)
    # Both full. b1 computed 7 prompts to b0's 3: more tokens, fewer per token of its 3x capacity.
    for engine, backend, prompts in ((small, candidates[0], 3), (large, candidates[1], 7)):
        for _ in range(prompts):
            _route_to(policy, engine, backend, gen.integers(0, 150_000, size=320).astype(np.uint32))
    events_say = CapacityModel(index, check_interval_s=0.0)
    assert (events_say.capacity_tokens("b0"), events_say.capacity_tokens("b1")) == (32 * 16, 96 * 16)
    req = request(gen.integers(0, 150_000, size=320).astype(np.uint32))
    choice = route(policy, req, candidates)
    assert choice.backend.name == "b1"
    assert choice.reason == "cold_spread"


def test_a_prediction_lapses_once_its_engine_has_churned_through_its_capacity(monkeypatch) -> None:
    clock = _fake_clock(monkeypatch)
    index, engines, by_name = _pressure_fleet()
    policy = _pressure_policy(index, prediction_ttl_s=5.0)
    gen = np.random.default_rng(5)
    document = gen.integers(0, 150_000, size=320).astype(np.uint32)
    _route_to(policy, engines["b0"], by_name["b0"], document)
    # Within the next second b0 computes 40 other prompts: 25 times its 512 tokens of capacity.
    for _ in range(40):
        clock[0] += 0.025
        _route_to(policy, engines["b0"], by_name["b0"], gen.integers(0, 150_000, size=320).astype(np.uint32))
    assert index.longest_cached_prefix(document, backends=["b0"])["b0"].tokens == 0  # evicted
    clock[0] = 1003.0  # within prediction_ttl_s of the routing
    req = request(np.concatenate([document, gen.integers(0, 150_000, size=32).astype(np.uint32)]))
    choice = route(policy, req, list(by_name.values()))
    # The engine's survival time (~2 s at this rate) is shorter than the prediction's age: no credit.
    assert choice.candidates["b0"]["predicted"] == 0
    assert choice.reason == "cold_spread"
