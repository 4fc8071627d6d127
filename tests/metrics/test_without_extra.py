"""Without the ``metrics`` extra hicache imports and runs; only hicache.metrics.prometheus (and
``hicache demo --metrics``) needs prometheus-client, and says which extra to install."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

BLOCKED = """
import sys
sys.modules["prometheus_client"] = None  # as if the extra were not installed
"""


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED + code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        check=False,
    )


def test_the_library_and_its_metrics_sources_import_without_prometheus_client() -> None:
    done = run(
        "import hicache, hicache.engine, hicache.bootstrap.cache, hicache.cli, hicache.metrics\n"
        "from hicache.metrics import HiCacheMetrics, IntegrationCounters\n"
        "IntegrationCounters('vllm').count_lookup(tokens=16, hit_tokens={'host': 16})\n"
        "print(len(HiCacheMetrics().families()))\n"
        "print('prometheus_client' in sys.modules and sys.modules['prometheus_client'])\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "None"]


def test_the_prometheus_module_names_the_extra_to_install() -> None:
    done = run(
        "from hicache.domain import ConfigError\n"
        "try:\n"
        "    import hicache.metrics.prometheus\n"
        "except ConfigError as e:\n"
        "    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'hicache[metrics]'" in done.stdout


def test_demo_metrics_without_the_extra_is_one_line_and_exit_2() -> None:
    done = run("from hicache.cli import main\nsys.exit(main(['demo', '--metrics', 'm.prom']))\n")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0
    assert "--metrics m.prom: needs prometheus-client" in done.stderr
    assert "hicache[metrics]" in done.stderr
