"""Engine events never reach stdout unless the application configured structlog to put them there.

structlog's default configuration prints to stdout; hicache's loggers (hicache.engine.logs) send
events to the standard library logger "hicache.*" instead (a NullHandler: silent) until the
application configures structlog. Each case runs in a fresh interpreter, where structlog is
unconfigured, and drives a real runtime (open, back up, load, close).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

RUN_ENGINE = """
import anyio
from hicache.bootstrap import load_model_spec
from hicache.bootstrap.runtime import open_runtime
from hicache.domain import PlanSettings, plan_stack

async def main():
    plan = plan_stack(load_model_spec("llama-3.1-8b-instruct"), PlanSettings(device_tokens=256))
    async with open_runtime(plan, device="cpu", name="quiet") as rt:
        pages = rt.device_slots.allocate({"kv": 2})
        backup = await rt.engine.backup(pages.pages)
        await backup.wait()
        load = await rt.engine.load(backup.host_pages)
        await load.wait()

anyio.run(main)
"""


def _run(prelude: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(prelude) + RUN_ENGINE
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False
    )


def test_an_application_that_configured_nothing_sees_nothing_on_stdout_or_stderr() -> None:
    proc = _run("")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "engine_" not in proc.stderr


def test_stdlib_logging_configured_by_the_application_receives_the_events() -> None:
    proc = _run(
        """
        import logging, sys
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(message)s")
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "hicache.engine engine_opened" in proc.stderr
    assert "hicache.engine engine_closed" in proc.stderr


def test_structlog_configured_by_the_application_gets_the_events_where_it_sends_them() -> None:
    proc = _run(
        """
        import sys, structlog
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "engine_opened" in proc.stderr


def test_the_broken_case_is_caught_structlog_defaults_print_on_stdout() -> None:
    """What the first test guards against: structlog's own logger prints on stdout by default."""
    proc = subprocess.run(
        [sys.executable, "-c", "import structlog; structlog.get_logger('x').info('event_x')"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "event_x" in proc.stdout


def test_every_engine_module_logs_through_the_quiet_logger() -> None:
    """A module that called structlog.get_logger directly would print on stdout by default."""
    import pathlib

    import hicache.engine

    root = pathlib.Path(hicache.engine.__file__).parent
    direct = [
        p.name
        for p in sorted(root.glob("*.py"))
        if p.name != "logs.py" and "structlog.get_logger(" in p.read_text()
    ]
    assert direct == []
