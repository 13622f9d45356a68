"""CPU per request of the missed-reuse accounting (router/missed_reuse.py), on against off: a
kv_aware Choice of 4 candidates, routed() and finished() on a streamed answer's last two pieces.

    .venv/bin/python -m benchmarks.missed_reuse_cost
"""

import timeit
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from router.missed_reuse import MissedReuse
from router.policies.base import Choice

cands = {
    f"b{i}": {
        "cached": 256 * i,
        "by_tier": {"gpu": 128 * i, "cpu": 256 * i},
        "predicted": 0,
        "in_flight": 1,
        "load": 10.0,
        "cost": 1.0,
    }
    for i in range(4)
}
ch = Choice(SimpleNamespace(name="b1"), "cache_vs_load", 256, None, cands)
tail = (
    b'data: {"choices":[{"delta":{"content":" word"}}]}\n\n'
    + b'data: {"choices":[],"usage":{"prompt_tokens":1200,'
    + b'"prompt_tokens_details":{"cached_tokens":256}}}\n\ndata: [DONE]\n\n'
)[-8192:]
for enabled in (True, False):
    m = MissedReuse(CollectorRegistry(), enabled)

    def one(m: MissedReuse = m) -> None:
        if m.enabled:
            m.routed(ch)
            m.finished(ch, 200, tail)

    n = 200000
    best = min(timeit.repeat(one, number=n, repeat=5)) / n
    print(f"enabled={enabled}: {best * 1e6:.2f} us/request")
