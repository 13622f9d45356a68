"""Paired rounds: the same request timed direct and through several routers in one round, in an
order that rotates over every position, and the medians read from them (benchmarks/real_added_latency.py's
head to head). Machines here are shared and drift by tenths of a millisecond over minutes: only
differences within a round, over many rounds, say what one router adds over another."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rotating_orders(sides: int) -> list[tuple[int, ...]]:
    """Every cyclic rotation of the sides and of their reverse: each side runs in every position
    equally often, after each of its neighbours and before it."""
    forward = list(range(sides))
    backward = forward[::-1]
    return [tuple(order[k:] + order[:k]) for order in (forward, backward) for k in range(sides)]


def duel_shape(
    sides: tuple[str, ...], names: tuple[str, str], references: tuple[str, ...], times: list[list[float]]
) -> dict:
    """One shape's medians from its rounds' times (seconds; times[0] direct, then `sides` in order)."""

    def over(a: list[float], b: list[float]) -> list[float]:
        return [(y - x) * 1000 for x, y in zip(a, b, strict=True)]

    by_side = dict(zip(sides, times[1:], strict=True))
    direct = times[0]
    second_over_first = over(by_side[names[0]], by_side[names[1]])
    return {
        "second_over_first_ms_p50": statistics.median(second_over_first),
        "second_over_first_ms_p90": percentile(second_over_first, 0.9),
        "first_added_ms_p50": statistics.median(over(direct, by_side[names[0]])),
        "second_added_ms_p50": statistics.median(over(direct, by_side[names[1]])),
        "direct_ms_p50": statistics.median(direct) * 1000,
        # Every side's added time over direct, references included.
        "added_ms_p50": {side: statistics.median(over(direct, by_side[side])) for side in sides},
        # Each router over each reference hop: what the router adds beyond the hop itself.
        "over_reference_ms_p50": {
            f"{name}_over_{reference}": statistics.median(over(by_side[reference], by_side[name]))
            for name in names
            for reference in references
        },
        "second_over_first_ms": second_over_first,
        "times_ms": {
            "direct": [t * 1000 for t in direct],
            **{s: [t * 1000 for t in by_side[s]] for s in sides},
        },
    }


def json_key(goal: str) -> str:
    """'socat over direct' -> socat_added_ms_p50, 'kv_aware over envoy' -> kv_aware_over_envoy_ms_p50."""
    name, _, reference = goal.split(" ")
    return f"{name}_added_ms_p50" if reference == "direct" else f"{name}_over_{reference}_ms_p50"


def reference_goals(duel: dict) -> list[tuple[str, str, float]]:
    """(what, worst shape, ms) for each reference hop over direct and each router over each hop."""
    shapes = duel["shapes"]
    found = []
    keys = [f"{reference} over direct" for reference in duel.get("references", [])]
    keys += [
        f"{name} over {reference}"
        for name in (duel["first"], duel["second"])
        for reference in duel.get("references", [])
    ]
    for key in keys:
        name, _, reference = key.split(" ")

        def value(shape: str, name: str = name, reference: str = reference) -> float:
            if reference == "direct":
                return shapes[shape]["added_ms_p50"][name]
            return shapes[shape]["over_reference_ms_p50"][f"{name}_over_{reference}"]

        worst = max(shapes, key=value)
        found.append((key, worst, value(worst)))
    return found
