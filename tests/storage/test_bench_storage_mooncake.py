"""`hicache bench storage --store mooncake`: starts a local cluster itself and leaves nothing behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.cli.bench_storage import KEYS, MOONCAKE_KEYS
from tests.storage.mooncake_support import PROBLEM

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

TINY = ["--pages", "4", "--page-size", "16", "--layers", "2", "--repeats", "1"]


def _mooncake_children() -> set[int]:
    """Mooncake processes (live or zombie) whose parent is this test process."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        if ppid == os.getpid() and comm.startswith("mooncake"):
            found.add(int(stat.parent.name))
    return found


def test_bench_starts_and_stops_a_local_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert PROBLEM is None
    assert _mooncake_children() == set()
    assert main(["bench", "storage", "--store", "mooncake", "--json", *TINY]) == 0
    doc = json.loads(capsys.readouterr().out.strip())
    assert tuple(doc) == KEYS + MOONCAKE_KEYS  # the client's own speed, timed beside
    assert doc["store"] == "mooncake"
    assert doc["pages"] == 4
    for key in ("put_gbps", "get_gbps", "raw_read_gbps", "raw_write_gbps", *MOONCAKE_KEYS):
        assert doc[key] > 0, key
    assert _mooncake_children() == set()  # every process it started was stopped and reaped
