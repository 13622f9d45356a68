"""What load costs on the engines behind the gateway, measured from the TTFTs it relays.

kv_aware prices a backend in prefill-token units: the prompt tokens it would compute, plus
`request_load_weight` per request already in flight there and `prefill_load_weight` per prompt token
still queued there. Fixed weights fit only the engines they were tuned on: a request in flight
delays the next one's first token by orders of magnitude more on a CPU engine than on the
simulator (docs/index.md, "kv_aware", has the fitted figures). With weights tuned on one, a fleet of
the other piles follow-up turns onto the engine holding them until their first tokens wait seconds.

`MeasuredLoadCosts` fits, over the streamed requests the gateway routed,

    ttft ~= a * uncached_tokens + b * in_flight + c * in_flight_prefill_tokens + d

(the load as it was when each request was sent), by least squares over exponentially decayed sums
so that recent requests count most, and offers b/a and c/a as the weights. The configured weights
stay floors: a measurement can raise them, never lower them, because TTFT does not show all that a
busy engine costs (decode slows down with the batch: throughput, not first tokens).
kv_aware uses it only with `measure_load_costs: true` (off by default: see docs/index.md for the
side-by-side runs where it lowered hit ratios on real engines).
Until `min_requests` have been measured, or while the fit is degenerate (no spread in the uncached
tokens, a non-positive cost per token), it offers nothing and the configured weights apply.
"""

from __future__ import annotations

import math

import numpy as np

# Features are scaled to similar magnitudes (thousands of tokens, requests) so that the small ridge
# that keeps the solve stable weighs them alike.
_TOKEN_SCALE = 1000.0
# Ridge on the load coefficients: with little spread in the load, they shrink toward zero (the
# configured floors then apply) instead of swinging; tiny on the per-token cost, which divides.
_LOAD_RIDGE = 1.0
_TOKEN_RIDGE = 1e-6
# A fit is redone every this many observations (a 4x4 solve: cheap, but not per request).
REFIT_EVERY = 8
# Ceilings on what a fit may offer (a request in flight worth at most this many prompt tokens; a
# queued prompt token at most this many of the request's own), against a wild fit.
MAX_REQUEST_WEIGHT = 65_536.0
MAX_PREFILL_WEIGHT = 8.0


class MeasuredLoadCosts:
    """Decayed least squares of TTFT on (uncached tokens, in-flight requests, in-flight prefill tokens)."""

    def __init__(self, half_life_requests: float, min_requests: int) -> None:
        self._decay = 0.5 ** (1.0 / half_life_requests)
        self._min_requests = min_requests
        self._xtx = np.zeros((4, 4))
        self._xty = np.zeros(4)
        self.observed = 0
        # What the last fit offers (prompt-token units), or None: use the configured weights.
        self.request_weight: float | None = None
        self.prefill_weight: float | None = None
        # The last fit's coefficients, for the debug page: seconds per token, per request, per
        # queued token, and the constant.
        self.coefficients: tuple[float, float, float, float] | None = None

    def observe(
        self, uncached_tokens: int, in_flight: int, in_flight_prefill_tokens: int, ttft_s: float
    ) -> None:
        """One streamed request: the load when it was sent, and its time to the first response piece."""
        if not (math.isfinite(ttft_s) and ttft_s >= 0 and uncached_tokens >= 0 and in_flight >= 0):
            return
        x = np.array(
            [uncached_tokens / _TOKEN_SCALE, in_flight, max(0, in_flight_prefill_tokens) / _TOKEN_SCALE, 1.0]
        )
        self._xtx *= self._decay
        self._xtx += np.outer(x, x)
        self._xty *= self._decay
        self._xty += ttft_s * x
        self.observed += 1
        if self.observed >= self._min_requests and self.observed % REFIT_EVERY == 0:
            self._refit()

    def _refit(self) -> None:
        system = self._xtx + np.diag([_TOKEN_RIDGE, _LOAD_RIDGE, _LOAD_RIDGE, 0.0])
        try:
            per_ktoken, per_request, per_queued_ktoken, constant = np.linalg.solve(system, self._xty)
        except np.linalg.LinAlgError:
            per_ktoken = math.nan
        self.coefficients = None
        self.request_weight = self.prefill_weight = None
        if not math.isfinite(per_ktoken) or per_ktoken <= 0:
            return
        self.coefficients = (
            per_ktoken / _TOKEN_SCALE,
            per_request,
            per_queued_ktoken / _TOKEN_SCALE,
            constant,
        )
        self.request_weight = min(MAX_REQUEST_WEIGHT, max(0.0, per_request) / per_ktoken * _TOKEN_SCALE)
        self.prefill_weight = min(MAX_PREFILL_WEIGHT, max(0.0, per_queued_ktoken) / per_ktoken)

    def describe(self) -> dict:
        """The fit as the debug page shows it."""
        seconds = self.coefficients
        return {
            "observed": self.observed,
            "request_weight": self.request_weight,
            "prefill_weight": self.prefill_weight,
            "ttft_model": None
            if seconds is None
            else {
                "us_per_uncached_token": round(seconds[0] * 1e6, 2),
                "ms_per_request_in_flight": round(seconds[1] * 1e3, 2),
                "us_per_queued_prefill_token": round(seconds[2] * 1e6, 2),
                "ms_constant": round(seconds[3] * 1e3, 2),
            },
        }
