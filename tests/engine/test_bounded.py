"""BoundedStorage: every call from a plain thread bounded by deadline + grace, a stuck call
refusing the next ones, recovery once it returns, and a close (and interpreter exit) that
never waits for a hung store."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from hicache.domain import ConfigError, PoolName
from hicache.domain.storage import StoreKey, StoreStatus
from hicache.engine.bounded import BoundedSettings, BoundedStorage, Outcome
from tests.storage.fakes import HangingStore

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[2]
KV = PoolName.KV
DEADLINE, GRACE = 0.2, 0.2
BOUND = DEADLINE + GRACE


def pkeys(n: int, tag: str = "p") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def page(fill: int) -> list[memoryview]:
    return [memoryview(bytearray([fill]) * 64)]


@pytest.fixture
def store() -> Iterator[HangingStore]:
    s = HangingStore()
    yield s
    s.release.set()  # never leave a test's thread hanging


@pytest.fixture
def bounded(store: HangingStore) -> Iterator[BoundedStorage]:
    b = BoundedStorage(store, BoundedSettings(deadline_s=DEADLINE, grace_s=GRACE))
    yield b
    store.release.set()
    b.close()


def test_calls_move_pages_by_key_and_answer_per_page(bounded: BoundedStorage) -> None:
    tier = bounded.tier({KV: "ns"}, [KV])
    keys = pkeys(3)
    assert tier.write(keys[:2], [page(1), page(2)]).value == [True, True]
    got = [page(0), page(0), page(0)]
    answer = tier.read_each(keys, got)
    assert answer.outcome is Outcome.ANSWERED
    assert answer.settled.done()
    assert answer.value == [StoreStatus.OK, StoreStatus.OK, StoreStatus.MISS]
    assert bytes(got[1][0]) == bytes([2]) * 64
    assert tier.exists(keys).value == 2
    assert tier.exists_each([keys[2], keys[0]]).value == [False, True]
    assert len(bounded.buffers) == 0  # every call's buffers are dropped once it ended


def test_a_keys_function_names_every_rank_of_a_page(bounded: BoundedStorage) -> None:
    def ranks(p: bytes) -> list[StoreKey]:
        return [StoreKey("ns", f"kv-r{r}", p.hex()) for r in range(2)]

    writer = bounded.tier({}, [KV], keys=lambda p: ranks(p)[:1])  # rank 0 only
    both = bounded.tier({}, [KV], keys=ranks)
    keys = pkeys(2)
    assert writer.write(keys, [page(1), page(2)]).value == [True, True]
    assert both.exists_each(keys).value == [False, False]  # rank 1 holds nothing
    assert both.tier.store_keys(keys[0])[1].pool == "kv-r1"


def test_a_hung_call_is_answered_with_its_default_by_deadline_plus_grace(
    store: HangingStore, bounded: BoundedStorage
) -> None:
    tier = bounded.tier({KV: "ns"}, [KV])
    store.hang.set()
    start = time.monotonic()
    answer = tier.read(pkeys(2), [page(0), page(0)])
    waited = time.monotonic() - start
    assert answer.outcome is Outcome.TIMEOUT
    assert answer.value == [False, False]
    assert BOUND <= waited < BOUND + 1.0
    assert not answer.settled.done()  # the store may still write the buffers
    assert bounded.stuck == 1
    assert bounded.statistics().timed_out_calls == 1


def test_while_a_call_is_stuck_calls_are_refused_at_once_and_logged_once(
    store: HangingStore, bounded: BoundedStorage
) -> None:
    tier = bounded.tier({KV: "ns"}, [KV])
    store.hang.set()
    tier.exists(pkeys(1))
    with structlog.testing.capture_logs() as logs:
        start = time.monotonic()
        answers = [
            tier.exists(pkeys(1)),
            tier.write(pkeys(1), [page(1)]),
            tier.read(pkeys(1), [page(0)]),
        ]
        assert time.monotonic() - start < GRACE
    assert [a.outcome for a in answers] == [Outcome.STUCK] * 3
    assert [a.value for a in answers] == [0, [False], [False]]
    assert all(a.settled.done() for a in answers)  # refused: their buffers were never handed on
    refusals = [e for e in logs if "refused" in e["event"]]
    assert len(refusals) == 1
    assert bounded.statistics().refused_while_stuck == 3
    assert store.calls["put"] == 0  # the store never saw the refused calls
    assert len(bounded.buffers) == 0  # refused calls leave no buffers registered


def test_calls_resume_once_the_stuck_call_returns(
    store: HangingStore, bounded: BoundedStorage
) -> None:
    tier = bounded.tier({KV: "ns"}, [KV])
    assert tier.write(pkeys(1), [page(5)]).value == [True]
    store.hang.set()
    buf = page(0)
    late = tier.read(pkeys(1), [buf])
    assert late.outcome is Outcome.TIMEOUT
    store.hang.clear()
    store.release.set()
    late.settled.result(timeout=5)
    assert bytes(buf[0]) == bytes([5]) * 64  # the late store call did write the buffer
    assert bounded.stuck == 0
    assert tier.read(pkeys(1), [page(0)]).outcome is Outcome.ANSWERED
    stats = bounded.statistics()
    assert (stats.timed_out_calls, stats.late_returns, stats.stuck_calls) == (1, 1, 0)
    assert len(bounded.buffers) == 0


def test_close_returns_within_the_bound_while_a_call_hangs_and_closes_the_store_later(
    store: HangingStore,
) -> None:
    bounded = BoundedStorage(store, BoundedSettings(deadline_s=DEADLINE, grace_s=GRACE))
    tier = bounded.tier({KV: "ns"}, [KV])
    store.hang.set()
    assert tier.exists(pkeys(1)).outcome is Outcome.TIMEOUT
    start = time.monotonic()
    bounded.close()
    assert time.monotonic() - start < BOUND + 0.5
    assert not store.closed  # never closed under a running call
    assert tier.exists(pkeys(1)).outcome is Outcome.CLOSED
    store.release.set()
    deadline = time.monotonic() + 10
    while not store.closed and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.closed
    bounded.close()  # idempotent


def test_close_with_no_call_running_closes_the_store_at_once(store: HangingStore) -> None:
    bounded = BoundedStorage(store, BoundedSettings(deadline_s=DEADLINE, grace_s=GRACE))
    bounded.tier({KV: "ns"}, [KV]).exists(pkeys(1))
    bounded.close()
    assert store.closed
    assert bounded.statistics().refused_closed == 0


def test_bad_input_raises_in_the_calling_thread(bounded: BoundedStorage) -> None:
    tier = bounded.tier({KV: "ns"}, [KV])
    with pytest.raises(ConfigError, match="one host page per page key"):
        tier.read(pkeys(2), [page(0)])
    two = bounded.tier({KV: "a", PoolName.INDEXER: "b"}, [KV, PoolName.INDEXER])
    with pytest.raises(ConfigError, match="mapping pool -> page buffers"):
        two.read(pkeys(1), [page(0)])
    assert len(bounded.buffers) == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("deadline_s", 0), ("deadline_s", -1.0), ("grace_s", float("nan")), ("grace_s", float("inf")),
     ("deadline_s", True), ("grace_s", "1"), ("deadline_s", 1e7), ("grace_s", 10**400)],
)  # fmt: skip
def test_settings_refuse_anything_but_finite_positive_seconds(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        BoundedSettings(**{field: value})  # type: ignore[arg-type]


EXIT_SCRIPT = """
import sys, threading, time
import hashlib
from hicache.domain import PoolName
from tests.storage.fakes import HangingStore
KV = PoolName.KV
def pkeys(n):
    return [hashlib.sha256(f"p{i}".encode()).digest() for i in range(n)]
def page(fill):
    return [memoryview(bytearray([fill]) * 64)]
from hicache.engine.bounded import BoundedSettings, BoundedStorage, Outcome
store = HangingStore()
store.hang.set()
b = BoundedStorage(store, BoundedSettings(deadline_s=0.2, grace_s=0.2))
tier = b.tier({KV: "ns"}, [KV])
assert tier.read(pkeys(1), [page(0)]).outcome is Outcome.TIMEOUT
if sys.argv[1] == "close":
    b.close()
print("exiting", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "no-close"])
def test_the_interpreter_exits_while_a_store_call_hangs(how: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", EXIT_SCRIPT, how],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=20,  # the store hangs for 30 s
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exiting" in proc.stdout
