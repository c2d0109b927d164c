"""Reads counts out of a Prometheus text (the control plane's ``gateway_metrics.txt``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name`` whose labels include ``labels`` (0 when there is none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )
