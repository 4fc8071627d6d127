"""The issue's target: a scrape of the metrics after ``hicache demo`` shows every tier's hits
equal to what the demo reports (its ``served_tokens``, tallied from the demo's own matches)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.cli import main

TINY = ["--prefix-tokens", "128", "--turns", "1"]


def test_the_scrape_after_the_demo_shows_every_tiers_hits_as_the_demo_reports_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "demo.prom"
    assert main(["demo", "--json", "--storage", "directory", "--metrics", str(path), *TINY]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert f"metrics written to {path}" in err
    hits: dict[str, float] = {}
    for fam in text_string_to_metric_families(path.read_text()):
        for s in fam.samples:
            if s.name == "hicache_hit_tokens_total":
                assert s.labels["cache"] == "demo"
                hits[s.labels["tier"]] = s.value
    served = doc["served_tokens"]
    assert hits == {tier: float(n) for tier, n in served.items()}
    # the demo's requests hit host and storage (each run's hit is one of them); its warm-up
    # prefetch's and the recompute's matches are counted as well, by both sides
    assert served["host"] >= sum(r["hit_tokens"] for r in doc["runs"])
    assert served["storage"] >= sum(r["hit_tokens"] for r in doc["runs"])


def test_demo_metrics_into_a_missing_folder_fails_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--metrics", str(tmp_path / "no" / "m.prom"), *TINY]) == 2
    _, err = capsys.readouterr()
    assert "its folder does not exist" in err
    assert "turn 1" not in err  # nothing ran


def test_bytes_per_pool_of_the_hybrid_demo_sum_to_the_face_totals() -> None:
    """The demo's plan has an anchor (kv), a sidecar (indexer), a window pool and state slots:
    a load's bytes land under each pool (the sidecar's under its own name) and add up."""
    import anyio

    from hicache.demo.workload import DemoSettings, run_demo
    from hicache.metrics import HiCacheMetrics
    from hicache.metrics.prometheus import exposition

    metrics = HiCacheMetrics()
    settings = DemoSettings(prefix_tokens=128, turns=1, storage="directory")
    anyio.run(lambda: run_demo(settings, metrics=metrics))
    (source,) = metrics.sources
    stats = source.cache.statistics()  # type: ignore[attr-defined]
    per: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(exposition(metrics)):
        for s in fam.samples:
            if s.name.endswith("_bytes_total") and "pool" in s.labels:
                what = s.name.removeprefix("hicache_").removesuffix("_bytes_total")
                per.setdefault(what, {})[s.labels["pool"]] = s.value
    assert set(per["loaded"]) == {"kv", "indexer", "swa", "mamba"}
    assert per["loaded"]["indexer"] > 0  # the sidecar's bytes, counted under its own name
    for what, want in (
        ("loaded", stats.bytes_loaded),
        ("backed_up", stats.bytes_backed_up),
        ("prefetched", stats.bytes_prefetched),
        ("stored", stats.bytes_stored),
    ):
        assert sum(per[what].values()) == want > 0, what
        assert per[what] == {k: float(v) for k, v in stats.bytes_by_pool[what].items()} | {
            k: 0.0 for k in per[what] if k not in stats.bytes_by_pool[what]
        }
