"""The replicas benchmark's report: averages per replica count and goal checks come from the runs."""

from __future__ import annotations

from kvgate_testing.replicas_report import averages_by_replicas, check_targets


def run(hit: float, load: float, ttft_p90: float) -> dict:
    return {"hit_ratio": hit, "max_over_mean_load": load, "ttft_p90": ttft_p90}


def test_averages_and_goals_follow_the_measurements() -> None:
    results: dict = {
        "workloads": {
            "chat": {"setups": {"1": run(0.80, 1.1, 100), "2_sync_on": run(0.79, 1.2, 110),
                                "2_sync_off": run(0.70, 1.9, 300), "4_sync_on": {"failed": "boom"}}},
            "docs": {"setups": {"1": run(0.60, 1.0, 200), "2_sync_on": run(0.60, 1.4, 190),
                                "2_sync_off": run(0.50, 1.5, 250)}},
        }
    }  # fmt: skip
    synced, unsynced = averages_by_replicas(results, "sync_on"), averages_by_replicas(results, "sync_off")
    assert synced["hit_ratio"] == {"1": 0.7, "2": 0.695}  # a failed setup is left out, not counted as 0
    assert unsynced["max_over_mean_load"] == {"1": 1.05, "2": 1.7}
    for measure, values in synced.items():
        results[f"{measure}_by_replicas"] = values
    verdicts = {check["what"]: check["met"] for check in check_targets(results)}
    assert verdicts["2 synced replicas: hit ratio within 2% of one replica's"]  # 0.7% lost
    assert verdicts["chat, 2_sync_on: load max/mean <= 1.3"]
    assert not verdicts["docs, 2_sync_on: load max/mean <= 1.3"]
    assert not any("sync_off" in what for what in verdicts)
