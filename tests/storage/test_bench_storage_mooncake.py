"""`hicache bench storage --store mooncake`: starts a local cluster itself and leaves nothing behind."""

from __future__ import annotations

import json
import subprocess

import pytest

from hicache.cli import main
from hicache.cli.bench_storage import KEYS
from tests.storage.test_mooncake import _PROBLEM

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

TINY = ["--pages", "4", "--page-size", "16", "--layers", "2", "--repeats", "1"]


def _mooncake_pids() -> set[int]:
    out = subprocess.run(
        ["pgrep", "-f", "mooncake_(master|client)"], capture_output=True, text=True, check=False
    ).stdout
    return {int(p) for p in out.split()}


def test_bench_starts_and_stops_a_local_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert _PROBLEM is None
    before = _mooncake_pids()
    assert main(["bench", "storage", "--store", "mooncake", "--json", *TINY]) == 0
    doc = json.loads(capsys.readouterr().out.strip())
    assert tuple(doc) == KEYS
    assert doc["store"] == "mooncake"
    assert doc["pages"] == 4
    for key in ("put_gbps", "get_gbps", "raw_read_gbps", "raw_write_gbps"):
        assert doc[key] > 0, key
    assert _mooncake_pids() <= before  # every process it started was stopped
