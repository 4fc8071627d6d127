"""The connector speaks: one start line per role, rate-limited warnings for damaged objects,
failed store calls and failed copies (structlog, through hicache.engine.logs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.integrations.vllm.logs import RateLimitedWarnings
from hicache.integrations.vllm.plan import LoadOp, SaveOp, StepPlan
from hicache.integrations.vllm.stats import ConnectorStats
from tests.integrations.vllm.vllm_support import require_vllm
from tests.integrations.vllm.worker_helpers import caches, key, transfers


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_of_one_kind_is_one_line_then_one_line_counting_the_suppressed() -> None:
    clock = Clock()
    warnings = RateLimitedWarnings(interval_s=30.0, clock=clock)
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            warnings.warn("store_put_failed", status="timeout")
        warnings.warn("load_failed", status="DeviceError")  # another kind: its own line
        clock.now += 29.0
        warnings.warn("store_put_failed", status="timeout")
        clock.now += 1.0
        warnings.warn("store_put_failed", status="fatal")
    lines = [(e["event"], e.get("suppressed"), e.get("status")) for e in logs]
    assert lines == [
        ("vllm.store_put_failed", 0, "timeout"),
        ("vllm.load_failed", 0, "DeviceError"),
        ("vllm.store_put_failed", 5, "fatal"),  # 4 in the burst and 1 at +29 s
    ]
    assert all(e["log_level"] == "warning" for e in logs)


@pytest.mark.parametrize(
    ("operation", "status", "event"),
    [
        ("get", "corrupt", "vllm.store_object_corrupt"),
        ("get", "transient", "vllm.store_get_failed"),
        ("get", "timeout", "vllm.store_get_failed"),
        ("put", "full", "vllm.store_put_failed"),
        ("exists", "refused", "vllm.store_exists_failed"),
        ("load", "DeviceError", "vllm.load_failed"),
        ("save", "RuntimeError", "vllm.save_failed"),
        ("get", "miss", None),  # a plain miss is normal
        ("save", "host_full", None),  # counted, not a warning
    ],
)
def test_each_counted_error_kind_is_warned_or_not(
    operation: str, status: str, event: str | None
) -> None:
    stats = ConnectorStats()
    with structlog.testing.capture_logs() as logs:
        stats.error(operation, status)
    assert [e["event"] for e in logs] == ([event] if event else [])


def test_a_damaged_object_read_by_the_worker_is_warned_once_as_corrupt(tmp_path: Path) -> None:
    w = transfers(caches(), DirectoryStore(DirectorySettings(root=tmp_path)))
    w.start_step(StepPlan(saves=[SaveOp("r", key(1), 0, 1, True), SaveOp("r", key(2), 1, 2, True)]))
    w.finish_step()
    w.wait_idle()
    for obj in tmp_path.rglob("*.obj"):
        data = bytearray(obj.read_bytes())
        data[-1] ^= 0xFF
        obj.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        op = LoadOp("q", (key(1), key(2)), (0, 1), (5, 6), (True, True))
        w.start_step(StepPlan(async_loads=[op]))
        w.finish_step()
        w.wait_idle()  # the store reads run on the connector's I/O thread
    w.close()
    corrupt = [e for e in logs if e["event"] == "vllm.store_object_corrupt"]
    assert len(corrupt) == 1  # two damaged objects, one line (the second is suppressed)
    assert corrupt[0]["operation"] == "get"


def test_each_role_logs_one_start_line_with_its_tiers_store_and_keys(tmp_path: Path) -> None:
    require_vllm()
    from tests.integrations.vllm.sched_harness import Harness

    with structlog.testing.capture_logs() as logs:
        h = Harness(tmp_path, store="directory", host_pages=16)
    h.close()
    started = {e["role"]: e for e in logs if e["event"] == "vllm.connector_started"}
    assert set(started) == {"scheduler", "worker"}
    for e in started.values():
        assert e["host_slots"] == 16
        assert e["host_bytes"] == 16 * e["page_bytes"] > 0
        assert e["state_slots"] == 0
        assert e["store"] == "dynamic"
        assert e["namespace"]
        assert "kv-r<rank>of<tp>" in e["keys"]
        assert e["tp_reads_heads"] == 1  # the harness's model: 1 KV head, read at any size
        assert (e["deadline_s"], e["grace_s"]) == (2.0, 1.0)
    assert started["worker"]["copier"] in ("memcpy", "torch")
    assert started["worker"]["rank"] == 0
