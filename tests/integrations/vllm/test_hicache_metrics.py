"""The connector's counts in hicache's own metrics (IntegrationCounters, source "vllm"), and its
extra config checked through HiCacheConfig, without starting vLLM."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.domain import ConfigError
from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey
from hicache.integrations.vllm import exporter
from hicache.integrations.vllm.plan import LoadOp, SaveOp, StepPlan
from hicache.integrations.vllm.scheduler import Scheduled
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.metrics import HiCacheMetrics
from hicache.metrics.prometheus import exposition
from tests.integrations.vllm.side_helpers import BS, Exists, prefill, side
from tests.integrations.vllm.worker_helpers import caches, key, transfers

TOKENS = list(range(1, 26))  # 6 full blocks and 1 token


def scrape(stats: ConnectorStats) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    metrics = HiCacheMetrics()
    metrics.add_source(stats.counters)
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(exposition(metrics)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"source": "vllm", **kw}.items()))


def test_each_admitted_request_counts_one_lookup_with_its_hits_per_tier() -> None:
    store = Exists()
    s = side(store=store)
    s.on_events(prefill(s, "a", TOKENS[:17], [0, 1, 2, 3, 4]))  # blocks 0-3 on host
    s.after_alloc("a", [], 0)
    for k in chain_keys(TOKENS, BS)[4:6]:  # blocks 4-5 only in the store
        store.held.add(str(StoreKey(namespace="t", pool="kv-r0", page_hash=k.hex())))
    assert s.match("b", TOKENS, 4) == (20, True)  # vLLM's own hit: block 0
    assert s.match("b", TOKENS, 4) == (20, True)  # asked again while waiting: one lookup
    s.after_alloc("b", list(range(10, 17)), 20)
    st = s.stats.counters.statistics()
    assert (st.lookups, st.lookup_tokens) == (2, 17 + 25)
    assert st.hit_tokens.as_dict() == {"device": 4, "host": 12, "storage": 8}
    got = scrape(s.stats)
    assert got[("hicache_integration_lookups_total", labels())] == 2
    assert got[("hicache_integration_hit_tokens_total", labels(tier="host"))] == 12
    assert got[("hicache_integration_hit_tokens_total", labels(tier="storage"))] == 8
    assert got[("hicache_integration_miss_tokens_total", labels(tier="storage"))] == 42 - 24


def test_a_full_host_tier_counts_save_errors() -> None:
    s = side(slots=2)
    s.match("a", TOKENS[:17], 0)
    s.build([Scheduled("a", TOKENS[:17], 0, 17)], lambda _r: [0, 1, 2, 3, 4])
    got = scrape(s.stats)
    host_full = labels(operation="save", status="host_full")
    assert got[("hicache_integration_errors_total", host_full)] == 2


def test_worker_loads_and_saves_count_pages_bytes_and_durations() -> None:
    w = transfers(caches())
    saves = [SaveOp("r", key(1), 3, 2, False), SaveOp("r", key(2), 1, 4, False)]
    w.start_step(StepPlan(saves=saves))
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    w.start_step(StepPlan(loads=[LoadOp("q", (key(1),), (3,), (5,), (False,))]))
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    w.close()
    st = w.stats.counters.statistics()
    assert st.saves == {"ok": 1, "failed": 0}
    assert (st.saved_pages, st.saved_bytes) == (2, 2 * w.page_bytes)
    assert st.loads == {"ok": 1, "failed": 0}
    assert (st.loaded_pages, st.loaded_bytes) == (1, w.page_bytes)
    assert st.save_seconds.count == 1
    assert st.load_seconds.count == 1
    got = scrape(w.stats)
    assert got[("hicache_integration_loaded_bytes_total", labels())] == w.page_bytes
    assert got[("hicache_integration_saves_total", labels(outcome="ok"))] == 1
    assert got[("hicache_integration_load_seconds_count", labels())] == 1


def test_a_store_miss_is_a_failed_load_and_a_get_error(tmp_path: Path) -> None:
    w = transfers(caches(), DirectoryStore(DirectorySettings(root=tmp_path)))
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 0, 1, True)]))
    w.finish_step()
    w.wait_idle()
    op = LoadOp("q", (key(1), key(2), key(3)), (1, 2, 3), (5, 6, 7), (True, True, True))
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_saves()  # saves settle off the step
    w.close()
    st = w.stats.counters.statistics()
    assert st.loads == {"ok": 0, "failed": 1}
    assert (st.loaded_pages, st.loaded_bytes) == (1, w.page_bytes)  # only the first arrived
    assert st.errors == {("get", "miss"): 2}
    got = scrape(w.stats)
    assert got[("hicache_integration_errors_total", labels(operation="get", status="miss"))] == 2


def test_save_seconds_agree_between_hicache_and_vllm_metrics_after_a_known_run() -> None:
    """hicache_integration_save_seconds (sum) and vllm:hicache_save_s count the same thing:
    the save copies' stream time, per step, summed over layers."""
    from hicache.integrations.vllm.vllm_metrics import HiCacheStats

    w = transfers(caches())
    vllm_side = HiCacheStats(data={})
    for step in range(3):
        w.start_step(StepPlan(saves=[SaveOp("r", key(10 + step), step, step + 1, False)]))
        for name in w.names:  # vLLM's save_kv_layer, layer by layer
            w.save_layer(name)
        w.finish_step()
        w.wait_saves()
        vllm_side.aggregate(HiCacheStats(data=w.stats.take()))  # get_kv_connector_stats
    w.close()
    hist = w.stats.counters.statistics().save_seconds
    assert hist.count == 3  # one observation per step with saves
    vllm_s = vllm_side.reduce()["save_s"]
    assert vllm_s > 0
    assert hist.sum == pytest.approx(vllm_s, rel=1e-9)


def test_a_damaged_object_is_counted_as_corrupt_not_as_a_miss(tmp_path: Path) -> None:
    w = transfers(caches(), DirectoryStore(DirectorySettings(root=tmp_path)))
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 0, 1, True)]))
    w.finish_step()
    w.wait_idle()
    (obj,) = tmp_path.rglob("*.obj")
    data = bytearray(obj.read_bytes())
    data[-1] ^= 0xFF  # one payload bit flipped: the checksum no longer matches
    obj.write_bytes(bytes(data))
    op = LoadOp("q", (key(1), key(2)), (1, 2), (5, 6), (True, True))
    w.start_step(StepPlan(async_loads=[op]))
    w.finish_step()
    w.wait_saves()
    w.close()
    st = w.stats.counters.statistics()
    assert st.loads == {"ok": 0, "failed": 1}
    assert st.errors == {("get", "corrupt"): 1, ("get", "miss"): 1}
    got = scrape(w.stats)
    assert got[("hicache_integration_errors_total", labels(operation="get", status="corrupt"))] == 1


def test_extra_config_over_the_environment_names_both_sources() -> None:
    with pytest.raises(ConfigError) as e:
        ConnectorSettings.from_extra_config({"host_gib": 2}, env={"HICACHE_PLAN_HOST_RATIO": "3"})
    assert "kv_connector_extra_config" in str(e.value)
    assert "HICACHE_PLAN_HOST_RATIO" in str(e.value)


def test_environment_fills_what_the_extra_config_leaves_out(tmp_path: Path) -> None:
    env = {
        "HICACHE_PLAN_HOST_SIZE": "2GiB",
        "HICACHE_STORAGE_BACKEND": "directory",
        "HICACHE_STORAGE_EXTRA_CONFIG": f'{{"root": "{tmp_path}"}}',
    }
    s = ConnectorSettings.from_extra_config({}, env=env)
    assert (s.host_gib, s.storage_backend, s.storage_path) == (2.0, "directory", str(tmp_path))
    s = ConnectorSettings.from_extra_config({"host_gib": 1, "storage_backend": "none"}, env=env)
    assert (s.host_gib, s.storage_backend) == (1.0, None)  # the extra config wins


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"HICACHE_STORAGE_BACKEND": "hf3fs"}, "env HICACHE_STORAGE_BACKEND"),
        ({"HICACHE_STORAGE_BACKEND": "directory"}, "needs a 'root'"),
        ({"HICACHE_STORAGE_BACKEND": "nonsense"}, "HICACHE_STORAGE_BACKEND"),
        ({"HICACHE_" + "NOT_A_KEY": "1"}, "HICACHE_" + "NOT_A_KEY"),
    ],
)
def test_a_bad_environment_value_names_its_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        ConnectorSettings.from_extra_config({}, env=env)


@pytest.mark.parametrize(
    "config", [{"metrics_port": 0}, {"metrics_port": "9400"}, {"metrics": "on"}]
)
def test_bad_metrics_keys_are_refused_naming_the_key(config: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=f"kv_connector_extra_config '{next(iter(config))}'"):
        ConnectorSettings.from_extra_config(config, env={})


def test_metrics_port_serves_this_process_counters() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = ConnectorSettings.from_extra_config({"metrics_port": port}, env={})
    url = exporter.export(settings, 0)
    assert url == f"http://127.0.0.1:{port}/metrics"
    assert exporter.export(settings, 1) == url  # once per process
    before = exporter.process_counters().statistics().lookups
    s = side()
    s.stats = ConnectorStats(exporter.process_counters())
    s.match("a", TOKENS, 0)
    s.after_alloc("a", [], 0)
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    lookups = {
        tuple(sorted(x.labels.items())): x.value
        for fam in text_string_to_metric_families(text)
        for x in fam.samples
        if x.name == "hicache_integration_lookups_total"
    }
    assert lookups[labels()] == before + 1
