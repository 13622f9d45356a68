"""Reading a Prometheus text page as numbers, so that a test can assert how much a counter moved
instead of what it reads after whatever ran before it."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def metric_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the page, keyed by its name and its labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample_key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())
