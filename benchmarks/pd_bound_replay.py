"""Replays a recorded pd_real run's conditional requests through the cost model
(router/pd_costs.py) to show what the open prefills' lower bound would have said at each decision,
beside the queue estimate the run recorded and the request's real time to its first token
(kvgate_testing/pd_replay.py says how the recording is read).

    python -m benchmarks.pd_bound_replay benchmarks/results/pd_real_fresh1.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvgate_testing.pd_replay import replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--run", default="conditional")
    args = parser.parse_args()
    for row in replay(args.results, args.run):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
