"""TP agreement over torch.distributed (gloo, 2 real processes on 127.0.0.1): every rank agrees
on the same hit for match and prefetch; a rank that dies or comes late makes the others miss
within the deadline, and the ranks then agree again; bad arguments are typed errors.

The rank processes are in tests/adapters/tp_ranks.py.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from hicache.adapters import tp_agreement
from hicache.adapters.tp_agreement import TorchRankAgreement
from hicache.domain.errors import ConfigError
from hicache.engine.ranks import RankAgreement
from tests.adapters import tp_ranks

DEADLINE = 3.0  # seconds, for the calls where a rank is dead, late or hung
# Where no miss is expected (the ranks do different work between calls): not what is tested.
NO_MISS_DEADLINE = 60.0
# Upper bounds on elapsed times prove "no hang" (without the guard, a store call to a stopped
# host did not return within 180 s); what a contended machine adds past the expected time is
# not the code's, so it is bounded this loosely.
NO_HANG = 20.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    scenario: str, tmp_path: Path, *, stopped: int | None = None, deadline: float = DEADLINE
) -> tuple[list[dict[str, Any] | None], list[int]]:
    """Start 2 rank processes on a fresh port; their JSON results (None: no result) and exit
    codes (-9: SIGKILLed). Rank ``stopped`` stops itself: it is killed once the other is done."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(
            target=tp_ranks.run_rank,
            args=(rank, 2, port, scenario, str(tmp_path), deadline),
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    for rank, p in enumerate(procs):
        if rank != stopped:
            p.join(180)
    codes = []
    for p in procs:
        if p.is_alive():  # pragma: no cover - a hang is the failure this guards
            p.kill()
            p.join()
        codes.append(p.exitcode if p.exitcode is not None else -999)
    results = []
    for rank in range(2):
        f = tmp_path / f"{rank}.json"
        results.append(json.loads(f.read_text()) if f.exists() else None)
    return results, codes


def during(r: dict[str, Any]) -> dict[str, int]:
    """A rank's statistics counted from its snapshot just before the call under test."""
    counts = ("calls", "agreed", "missed", "diverged")
    return {k: r["statistics"][k] - r["before"][k] for k in counts}


def test_ranks_holding_different_pages_agree_on_the_minimum_for_match_and_prefetch(
    tmp_path: Path,
) -> None:
    (r0, r1), codes = run_ranks("agree", tmp_path, deadline=NO_MISS_DEADLINE)
    assert codes == [0, 0]
    assert r0 is not None
    assert r1 is not None
    # What each rank holds on its own (device, host, storage pages of the 4-page prompt).
    assert r0["local"] == [4, 4, 4]
    assert r1["local"] == [2, 2, 2]
    for r in (r0, r1):
        assert r["match"] == [2, 2, 2]
        assert r["match_after_device_eviction"] == [0, 2, 2]  # rank 0 kept it on host only
        assert r["match_storage_only"] == [0, 0, 2]
        assert r["prefetch"] == [2, 2, 2]  # both read up to the agreed hint, report it
        assert r["match_after_prefetch"] == [0, 2, 2]
        assert r["restored_pages"] == 2  # the loaded pages are the bytes each rank computed
        assert r["negative_values"] == "ConfigError"
        stats = r["statistics"]
        assert stats["missed"] == 0
        assert stats["agreed"] == stats["calls"] == 6  # 4 matches (one each), 2 per prefetch


def test_a_killed_rank_makes_the_other_miss_within_the_deadline(tmp_path: Path) -> None:
    (r0, r1), codes = run_ranks("dead", tmp_path)
    assert codes[1] == -9
    assert r1 is None
    assert codes[0] == 0
    assert r0 is not None
    assert r0["first"] == [5, 6]
    assert r0["match"] == [0, 0, 0]  # rank 0 holds 4 pages: a miss, not its own hit
    assert DEADLINE * 0.9 <= r0["elapsed"] <= DEADLINE + NO_HANG
    assert during(r0) == {"calls": 1, "agreed": 0, "missed": 1, "diverged": 0}
    assert "did not come within the deadline" in r0["statistics"]["last_error"]


def test_a_late_rank_gets_the_same_miss_and_the_next_call_agrees_again(tmp_path: Path) -> None:
    (r0, r1), codes = run_ranks("late", tmp_path)
    assert codes == [0, 0]
    assert r0 is not None
    assert r1 is not None
    assert r0["first"] == r1["first"] == [5]
    # Rank 0 gave up at its deadline; rank 1 came later and finds the recorded miss at once
    # (it does not wait out a deadline of its own).
    assert r0["late_call"] == r1["late_call"] == [0, 0]
    assert DEADLINE * 0.9 <= r0["elapsed"] <= DEADLINE + NO_HANG
    assert r1["elapsed"] < DEADLINE
    assert r0["next_call"] == r1["next_call"] == [20, 3]
    for r in (r0, r1):
        assert r["statistics"]["missed"] == 1
        assert r["statistics"]["agreed"] == 2


def test_the_store_hosts_death_makes_the_other_rank_miss_at_once(tmp_path: Path) -> None:
    (r0, r1), codes = run_ranks("store_dead", tmp_path)
    assert codes[0] == -9
    assert r0 is None
    assert codes[1] == 0
    assert r1 is not None
    assert r1["first"] == [5]
    assert r1["after"] == [0]
    # At once: a broken connection, not the deadline (nor the guard, 5 s past it).
    assert r1["elapsed"] < DEADLINE
    assert during(r1) == {"calls": 1, "agreed": 0, "missed": 1, "diverged": 0}
    assert "store failed" in r1["statistics"]["last_error"]


def test_a_hung_store_host_makes_the_other_rank_miss_at_its_guard(tmp_path: Path) -> None:
    (r0, r1), codes = run_ranks("store_hung", tmp_path, stopped=0)
    assert codes[0] == -9
    assert r0 is None
    assert codes[1] == 0
    assert r1 is not None
    assert r1["first"] == [5]
    assert r1["after"] == [0]
    guard = DEADLINE + tp_ranks.GRACE
    assert guard - 0.2 <= r1["elapsed"] <= guard + NO_HANG
    assert during(r1) == {"calls": 1, "agreed": 0, "missed": 1, "diverged": 0}
    assert "did not answer" in r1["statistics"]["last_error"]


# ---- in this process: one rank, and bad arguments -----------------------------------------


@pytest.fixture
def one_rank() -> Iterator[None]:
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_one_rank_agrees_with_itself_and_is_a_rank_agreement(one_rank: None) -> None:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=NO_MISS_DEADLINE)
    assert isinstance(ranks, RankAgreement)

    async def calls() -> list[tuple[int, ...]]:
        return [
            await ranks.agree_min((3, 1, 2)),
            await ranks.agree_min(()),
            await ranks.agree_min([7]),
        ]

    assert anyio.run(calls) == [(3, 1, 2), (), (7,)]
    stats = ranks.statistics()
    assert (stats.calls, stats.agreed, stats.missed) == (3, 3, 0)


@pytest.mark.parametrize(
    ("values", "named"),
    [((1, -1), "-1"), ((1, True), "True"), ((1.5,), "1.5"), ("12", "'12'"), (None, "None")],
)
def test_bad_values_are_refused_naming_them(one_rank: None, values: Any, named: str) -> None:
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=1.0)
    with pytest.raises(ConfigError, match="values") as e:
        anyio.run(ranks.agree_min, values)
    assert named in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"group": None}, "group"),
        ({"deadline_s": math.nan}, "deadline_s"),
        ({"deadline_s": math.inf}, "deadline_s"),
        ({"deadline_s": 0}, "deadline_s"),
        ({"deadline_s": -1.0}, "deadline_s"),
        ({"deadline_s": True}, "deadline_s"),
        ({"deadline_s": "1"}, "deadline_s"),
        ({"grace_s": math.nan}, "grace_s"),
        ({"name": ""}, "name"),
        ({"name": "a/b"}, "name"),
        ({"group": "world"}, "ProcessGroup"),
        ({"store": "tcp://127.0.0.1:1"}, "store"),
    ],
)
def test_bad_arguments_are_typed_errors_naming_the_argument(
    one_rank: None, kwargs: dict[str, Any], named: str
) -> None:
    args: dict[str, Any] = {"group": dist.group.WORLD, **kwargs}
    with pytest.raises(ConfigError, match=named):
        TorchRankAgreement(**args)


def test_building_one_before_torch_distributed_is_initialised_says_so() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="init_process_group"):
        TorchRankAgreement(object(), deadline_s=1.0)  # type: ignore[arg-type]


class SlowStore(Store):
    """A store that answers ``set`` or ``compare_set`` after ``delay`` seconds (a hung host)."""

    def __init__(self, slow: str) -> None:
        super().__init__()
        self.inner = dist.HashStore()
        self.slow = slow
        self.delay = 0.0

    def _pause(self, op: str) -> None:
        if op == self.slow:
            time.sleep(self.delay)

    def set(self, key: str, value: str) -> None:
        self._pause("set")
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        self._pause("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.inner.multi_get(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)


def test_a_store_that_stops_answering_is_a_miss_at_deadline_plus_grace(one_rank: None) -> None:
    store = SlowStore("set")
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=2.0, grace_s=0.5, store=store)
    assert anyio.run(ranks.agree_min, (4, 5)) == (4, 5)
    store.delay = 4.0
    started = time.monotonic()
    assert anyio.run(ranks.agree_min, (6, 7)) == (0, 0)
    assert 2.45 <= time.monotonic() - started <= 2.5 + NO_HANG
    stats = ranks.statistics()
    assert (stats.agreed, stats.missed, stats.diverged) == (1, 1, 0)
    assert stats.last_error is not None
    assert "did not answer" in stats.last_error


def test_an_answer_after_the_guard_gave_up_is_counted_as_diverged(one_rank: None) -> None:
    # The store records the agreed values but answers after this rank returned its miss: the
    # other ranks (had there been any) hit where this one missed. It must not pass silently.
    # The deadline leaves the thread time to propose (a contended machine's thread hop); the
    # store's answer comes after the guard (deadline + grace).
    store = SlowStore("compare_set")
    ranks = TorchRankAgreement(dist.group.WORLD, deadline_s=2.0, grace_s=0.5, store=store)
    store.delay = 3.0
    assert anyio.run(ranks.agree_min, (6, 7)) == (0, 0)
    stop = time.monotonic() + 30
    while ranks.statistics().diverged == 0 and time.monotonic() < stop:
        time.sleep(0.05)
    stats = ranks.statistics()
    assert (stats.agreed, stats.missed, stats.diverged) == (0, 1, 1)


def test_old_calls_keys_are_deleted_so_the_store_does_not_grow(
    one_rank: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tp_agreement, "KEEP_CALLS", 4)
    store = dist.HashStore()
    ranks = TorchRankAgreement(
        dist.group.WORLD, deadline_s=NO_MISS_DEADLINE, store=store, name="keys"
    )

    async def calls() -> None:
        for i in range(7):
            assert await ranks.agree_min((i,)) == (i,)

    anyio.run(calls)
    prefix = "keys/tp/0/0"  # name / tp / the group's ranks / generation
    gone = [f"{prefix}/{c}/{what}" for c in (0, 1, 2) for what in ("0", "outcome")]
    kept = [f"{prefix}/{c}/{what}" for c in (3, 4, 5, 6) for what in ("0", "outcome")]
    assert not any(store.check([k]) for k in gone)
    assert all(store.check([k]) for k in kept)
