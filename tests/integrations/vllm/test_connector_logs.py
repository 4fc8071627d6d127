"""The connector speaks: one start line per role, rate-limited warnings for damaged objects,
failed store calls and failed copies (structlog, through hicache.engine.logs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


# what vLLM does as it starts an engine (vllm/logger.py configure_logging)
VLLM_SETUP = (
    "from vllm.config.logging import LoggingConfig; from vllm.logger import configure_logging; "
    "configure_logging(LoggingConfig())"
)
_FOLLOW = """
import logging, sys
{setup}
from hicache.integrations.vllm.logs import follow_vllm_logging, log
print(follow_vllm_logging(), follow_vllm_logging(), file=sys.stdout, flush=True)
log.info("vllm.connector_started", role="scheduler")
log.warning("vllm.store_put_failed", status="timeout")
"""


def _follow(setup: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _FOLLOW.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )


@pytest.mark.vllm
def test_under_vllm_the_connector_lines_print_with_vllms_handler_and_level() -> None:
    """vLLM configures only its ``vllm`` logger; without follow_vllm_logging hicache's lines
    went nowhere (a NullHandler), so a `vllm serve` user saw no start line."""
    require_vllm()
    out = _follow(VLLM_SETUP, VLLM_LOGGING_LEVEL="INFO", VLLM_LOGGING_STREAM="ext://sys.stderr")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]  # a second call adds no second handler
    lines = [ln for ln in out.stderr.splitlines() if "vllm.connector_started" in ln]
    assert len(lines) == 1
    # vLLM's format: level, time, [file:line] of the caller (here the -c text), not hicache's logger
    assert re.search(
        r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[<string>:\d+\] vllm\.connector_started", lines[0]
    )
    assert "role='scheduler'" in lines[0]
    assert sum("vllm.store_put_failed" in ln for ln in out.stderr.splitlines()) == 1


@pytest.mark.vllm
def test_vllms_level_and_its_switch_apply_to_the_connector_lines() -> None:
    require_vllm()
    quiet = _follow(
        VLLM_SETUP, VLLM_LOGGING_LEVEL="WARNING", VLLM_LOGGING_STREAM="ext://sys.stderr"
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "vllm.connector_started" not in quiet.stderr  # info, under vLLM's WARNING
    assert "vllm.store_put_failed" in quiet.stderr
    off = _follow(VLLM_SETUP, VLLM_CONFIGURE_LOGGING="0")
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "False"]
    assert "vllm.connector_started" not in off.stderr + off.stdout


def test_an_application_that_configured_logging_keeps_it_and_sees_each_line_once() -> None:
    out = _follow(
        "logging.basicConfig(level='INFO', format='APP %(name)s %(message)s'); "
        "logging.getLogger('vllm').addHandler(logging.StreamHandler())"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    lines = [ln for ln in out.stderr.splitlines() if "vllm.connector_started" in ln]
    assert lines == ["APP hicache.vllm vllm.connector_started role='scheduler'"]
