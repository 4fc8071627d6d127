"""The TP rank agreement over torch.distributed: one process per rank, a deadline, never a hang.

- TorchRankAgreement(group, deadline_s=1.0, store=None, name="hicache"): implements the
  engine's RankAgreement port (hicache.engine.ranks: ``await agree_min(values)``, the
  element-wise minimum over the ranks of ``group``) for HiCache's ``match`` and ``prefetch``.
  ``group``: the framework's TP process group (gloo or NCCL; ``dist.group.WORLD`` or a
  ``dist.new_group``); ``store``: a c10d Store every rank of the group reaches (default: the
  store of the default process group, the one ``init_process_group`` made).
- AgreementStatistics: calls, agreed, missed (deadline passed or store failed) of one rank.

How: an exchange over the store, keyed by the group's ranks, a generation and a call number,
run off the event loop (``anyio.to_thread``). Rank r of call k sets ``.../k/r`` to its values,
waits (at most ``deadline_s``) for every rank's key of call k, and proposes the minimum, or
"miss" when a rank's values did not come in time, with ``compare_set`` on ``.../k/outcome``: the
first proposal wins and every rank, however late, returns that one outcome (a late rank finds
"miss" and misses too). A miss is zeros: no hit on any tier, for every rank of the group.

Why not an all-reduce on the group: a collective cannot be abandoned. A gloo all-reduce with a
timeout that fires on one rank while the late rank's data arrives on another completes on one
and fails on the other (they disagree), and leaves the pair's buffers out of step for the
framework's next collective on that group; an NCCL all-reduce whose peer died stays enqueued on
the GPU stream. The store needs no collective: a dead peer costs the others ``deadline_s``
(``store.wait`` times out); a dead store host fails every call at once (a broken connection).
SGLang reduces the same counts with MIN over a gloo group (cache_controller.py,
``prefetch_thread_func``; hiradix_cache.py, ``check_prefetch_progress``), without a deadline.

Every rank must call ``agree_min`` the same number of times, in the same order (HiCache does:
one or more calls per ``match``, two per ``prefetch``), and build one TorchRankAgreement per
cache (the generation is counted by the store: a rank that builds two is out of step with the
others, whose calls then all miss). Keys of a call are deleted ``KEEP_CALLS`` calls later.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta

import anyio
import anyio.to_thread
import attrs
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from hicache.domain.errors import ConfigError
from hicache.domain.limits import bounded_seconds

log = logging.getLogger("hicache.tp")

KEEP_CALLS = 1024  # a call's keys live this many calls; a rank lagging more could misread one
_MISS = "miss"
_OK = "ok:"


@attrs.frozen
class AgreementStatistics:
    """One rank's agreements: ``calls``; ``agreed`` (every rank in time); ``missed`` (a rank
    late or dead, or the store unreachable: zeros returned); ``diverged`` (calls this rank gave
    up on at its guard, ``deadline_s + grace_s``, that the store later answered with agreed
    values: the other ranks hit where this one missed; logged as an error); ``last_error`` (why
    the last miss)."""

    calls: int
    agreed: int
    missed: int
    diverged: int
    last_error: str | None


def _encode(values: Sequence[int]) -> str:
    return ",".join(str(v) for v in values)


def _decode(raw: bytes) -> tuple[int, ...]:
    text = raw.decode()
    return tuple(int(v) for v in text.split(",")) if text else ()


class TorchRankAgreement:
    """Element-wise minimum over the ranks of a torch.distributed group, within a deadline."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        deadline_s: float = 1.0,
        store: Store | None = None,
        name: str = "hicache",
        grace_s: float = 5.0,
    ) -> None:
        if group is None:
            raise ConfigError(
                "group must be the framework's TP process group (a torch.distributed "
                "ProcessGroup: dist.group.WORLD or dist.new_group(ranks)), got None"
            )
        for arg, value in (("deadline_s", deadline_s), ("grace_s", grace_s)):
            bounded_seconds(value, arg, positive=True)
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"name must be a non-empty string without '/', got {name!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "TorchRankAgreement needs torch.distributed initialised: call "
                "torch.distributed.init_process_group(...) on every rank first"
            )
        if not isinstance(group, dist.ProcessGroup):
            raise ConfigError(
                f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}"
            )
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        if not isinstance(store, Store):
            raise ConfigError(f"store must be a torch.distributed Store, got {store!r}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError(
                f"this process (global rank {dist.get_rank()}) is not a member of group {group!r}"
            )
        self.group = group
        self.rank = rank
        self.world_size = dist.get_world_size(group)
        self.deadline_s = float(deadline_s)
        self.grace_s = float(grace_s)
        self._store = store
        members = "-".join(str(r) for r in dist.get_process_group_ranks(group))
        base = f"{name}/tp/{members}"
        # Every rank adds 1 once: ranks 1..N of the count make generation 0, N+1..2N the next.
        generation = (store.add(f"{base}/instances", 1) - 1) // self.world_size
        self._prefix = f"{base}/{generation}"
        self._next_call = 0
        self._lock = threading.Lock()  # statistics: updated by exchange threads
        self._calls = self._agreed = self._missed = self._diverged = 0
        self._last_error: str | None = None
        # Where a call's thread leaves its outcome, and the calls the guard gave up on (a hung
        # store): whichever of the thread and the guard takes the lock first decides.
        self._outcomes: dict[int, tuple[int, ...] | None] = {}
        self._abandoned: set[int] = set()

    # ---- the port ----------------------------------------------------------------------------
    async def agree_min(self, values: Sequence[int]) -> tuple[int, ...]:
        """The element-wise minimum of ``values`` over the group's ranks, or zeros (a miss)
        when a rank's values did not come within ``deadline_s`` or the store failed."""
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ConfigError(f"values must be a sequence of ints >= 0, got {values!r}")
        mine = tuple(values)
        bad = [v for v in mine if isinstance(v, bool) or not isinstance(v, int) or v < 0]
        if bad:
            raise ConfigError(f"values must be ints >= 0, got {bad[0]!r} in {mine!r}")
        call = self._next_call  # taken before any await: the call order is the caller's
        self._next_call += 1
        started = time.monotonic()
        with anyio.move_on_after(self.deadline_s + self.grace_s):
            # Abandoned at the guard (a hung store): the thread ends on its own, its call's
            # keys are the only thing it touches.
            await anyio.to_thread.run_sync(self._run, call, mine, started, abandon_on_cancel=True)
        with self._lock:
            finished = call in self._outcomes
            outcome = self._outcomes.pop(call, None)
            if not finished:
                self._abandoned.add(call)
        if not finished:
            self._missed_because(call, "the store did not answer within deadline_s + grace_s")
        return outcome if outcome is not None else (0,) * len(mine)

    def statistics(self) -> AgreementStatistics:
        with self._lock:
            return AgreementStatistics(
                calls=self._calls,
                agreed=self._agreed,
                missed=self._missed,
                diverged=self._diverged,
                last_error=self._last_error,
            )

    # ---- the exchange (a worker thread) ------------------------------------------------------
    def _run(self, call: int, values: tuple[int, ...], started: float) -> None:
        with self._lock:
            self._calls += 1
        got = self._exchange(call, values, started)
        with self._lock:
            late = call in self._abandoned
            self._abandoned.discard(call)
            if not late:
                self._outcomes[call] = got if isinstance(got, tuple) else None
                self._agreed += isinstance(got, tuple)
            elif isinstance(got, tuple):
                self._diverged += 1
        if late and isinstance(got, tuple):
            # This rank returned a miss at its guard, the others the agreed values.
            log.error(
                "tp agreement %d of rank %d: the store answered %s after this rank gave up "
                "(deadline_s + grace_s): the ranks disagreed on this call",
                call,
                self.rank,
                got,
            )
        elif not late and isinstance(got, str):
            self._missed_because(call, got)

    def _exchange(
        self, call: int, values: tuple[int, ...], started: float
    ) -> tuple[int, ...] | str:
        """The agreed values, or why this call misses."""
        store = self._store
        key = f"{self._prefix}/{call}"
        outcome_key = f"{key}/outcome"
        try:
            store.set(f"{key}/{self.rank}", _encode(values))
            if store.check([outcome_key]):  # a late rank: the others decided already
                outcome = store.get(outcome_key)
            else:
                outcome = store.compare_set(outcome_key, "", self._proposal(key, started))
        except (RuntimeError, OSError, ValueError) as e:  # torch's DistError is a RuntimeError
            return f"store failed: {e}".splitlines()[0]
        try:
            self._forget(call)
        except (RuntimeError, OSError) as e:  # the outcome stands; old keys stay a while
            log.warning("tp agreement %d of rank %d: old keys not deleted: %s", call, self.rank, e)
        if not outcome.startswith(_OK.encode()):
            return "a rank's values did not come within the deadline"
        agreed = _decode(outcome[len(_OK) :])
        if len(agreed) != len(values):
            return f"ranks gave {len(agreed)} values, this rank {len(values)}"
        return agreed

    def _proposal(self, key: str, started: float) -> str:
        store = self._store
        keys = [f"{key}/{r}" for r in range(self.world_size)]
        left = self.deadline_s - (time.monotonic() - started)
        if left <= 0:
            return _MISS
        try:
            store.wait(keys, timedelta(seconds=left))
        except dist.DistStoreError:  # the wait timed out: a rank is late or dead
            return _MISS
        got = [_decode(v) for v in store.multi_get(keys)]
        if len({len(v) for v in got}) != 1:
            return _MISS  # ranks called with tuples of different lengths: out of step
        return _OK + _encode([min(col) for col in zip(*got, strict=True)])

    def _forget(self, call: int) -> None:
        old = call - KEEP_CALLS
        if old < 0:
            return
        self._store.delete_key(f"{self._prefix}/{old}/{self.rank}")
        if self.rank == 0:
            self._store.delete_key(f"{self._prefix}/{old}/outcome")

    def _missed_because(self, call: int, why: str) -> None:
        with self._lock:
            self._missed += 1
            self._last_error = why
        log.warning("tp agreement %d of rank %d missed: %s", call, self.rank, why)

    def __repr__(self) -> str:
        return (
            f"<TorchRankAgreement rank {self.rank}/{self.world_size} "
            f"deadline {self.deadline_s}s {self._prefix}>"
        )


__all__ = ["KEEP_CALLS", "AgreementStatistics", "TorchRankAgreement"]
