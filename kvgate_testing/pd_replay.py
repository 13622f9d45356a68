"""A recorded pd_real run's conditional requests replayed through the cost model
(router/pd_costs.py): what the open prefills' lower bound would have said at each decision, beside
the queue estimate the run recorded and the request's real time to its first token. Used by
benchmarks/pd_bound_replay.py and tests/test_pd_open_prefills.py.

The recording has each request's start and time to its first token, not its prefill leg's answer:
a split's prefill leg is taken as open from its start to its first token (a little longer than it
was, which makes the ages a little older than they were), and its answer as coming then. Each
answer teaches the prefill fit of its engine (split: the prefill engine; colocated: the decode
engine) with the tokens it computed plus those queued before it, as the gateway does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from router.config import Disaggregation
from router.pd_costs import CostModel, OpenPrefill


@dataclass(slots=True)
class _Running:
    engine: str
    own_tokens: int  # what it adds to the engine's in-flight prefill tokens
    observed_tokens: int  # its own plus those queued before it: what the fit learns on
    seconds: float
    answered_at: float
    opened: OpenPrefill | None


def replay(path: Path, run: str = "conditional") -> list[dict]:
    recorded = json.loads(path.read_text())["runs"][run]
    requests = sorted(
        (r for r in recorded["requests"] if r.get("decision") and r.get("ttft_s") is not None),
        key=lambda r: r["start_s"],
    )
    model = CostModel(Disaggregation())  # the defaults the runs used
    running: list[_Running] = []
    rows = []
    for request in requests:
        start = request["start_s"]
        for answered in [r for r in running if r.answered_at <= start]:
            costs = model.engine(answered.engine)
            costs.prefill.observe(answered.observed_tokens, answered.seconds)
            costs.close_prefill(answered.opened)
            running.remove(answered)
        decision = request["decision"]
        tokens = decision["prompt_tokens"]
        split = decision["estimates"].get("split")
        row = {
            "start_s": start,
            "kind": request["kind"],
            "option": decision["option"],
            "prompt_tokens": tokens,
            "ttft_s": round(request["ttft_s"], 2),
        }
        if split is not None:
            prefill_engine = split["prefill_backend"]
            figures = model.figures(prefill_engine, now=start)
            queued = sum(r.own_tokens for r in running if r.engine == prefill_engine)
            decode = model.figures(split["backend"], now=start)
            row |= {
                "decode_figure_us_per_token": round(decode.prefill_s_per_token * 1e6),
                "recorded_split_queue_s": split["queue_s"],
                "queued_tokens": queued,
                "bound_us_per_token": round(figures.prefill_bound_s_per_token * 1e6),
                "figure_us_per_token": round(figures.prefill_s_per_token * 1e6),
                "replayed_split_queue_s": round(queued * figures.prefill_s_per_token, 2),
                "replayed_split_queue_and_compute_s": round(
                    (queued + tokens) * figures.prefill_s_per_token, 2
                ),
            }
        engine = split["prefill_backend"] if decision["option"] == "split" else request["backend"]
        queued = sum(r.own_tokens for r in running if r.engine == engine)
        costs = model.engine(engine)
        # Only prefills whose first token ends them count; a colocated one loads nothing here.
        opened = costs.open_prefill(tokens, queued, sent_at=start)
        running.append(
            _Running(engine, tokens, tokens + queued, request["ttft_s"], start + request["ttft_s"], opened)
        )
        rows.append(row)
    return rows
