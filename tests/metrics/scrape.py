"""Reading a Prometheus scrape in the metrics tests: samples(text) parses it with
prometheus_client's own parser, value(scrape, name, **labels) reads one sample."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    """Every sample of a scrape by (sample name, sorted labels), via prometheus's parser."""
    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: Samples, name: str, **labels: str) -> float:
    return scrape[(name, tuple(sorted(labels.items())))]
