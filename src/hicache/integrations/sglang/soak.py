"""The SGLang path of ``hicache bench soak``: HiCacheBackend under random batch calls, with faults.

- soak_sglang(ops, seed, sabotage) -> PathReport: one HiCacheBackend (interface_v1, the
  zero-copy calls SGLang's cache controller makes: python/sglang/srt/managers/cache_controller.py)
  over SGLang's own ``MHATokenToKVPoolHost`` (hicache.integrations.sglang.bench.host_pool: bf16,
  CPU, page_first_direct), its store a DirectoryStore (checksums on) under FaultyStore:
  TRANSIENT / FATAL / FULL answers, bytes flipped on disk after a put, stalls within the
  deadline, and now and then a call that sleeps past it ("slow": the bounded storage answers it
  as failed).
- Each operation draws a request: page keys chained like SGLang's (each key a digest of the one
  before and of the page's tokens), from one of 6 roots, branching at a random page, 1-8 pages;
  then one of: ``batch_set_v1`` (the pages filled from their key, written from the first half
  of the host pool), ``batch_exists`` (how many leading pages the store has) and
  ``batch_get_v1`` into the second half, every page answered True compared byte by byte with
  the pattern of its key, or the legacy ``batch_set`` / ``batch_get`` of flat pages.
- Checks: a page read True must hold its key's bytes (corrupt otherwise); a True for a key
  never written is corrupt too; the Trues of a get must be a leading run and ``batch_exists``
  never more than the request's pages (errors otherwise, as is any exception out of a call);
  at the end, once the store calls are done, leaks: store calls still running past their
  bound, and temporary files left in the store's directory.
- ``sabotage``: "damage" (every page a get read OK is damaged afterwards, past the checksum)
  and "hang" (one get hangs past its bound until the soak ends: a stuck call): each shows its
  check can fail.
"""

from __future__ import annotations

import hashlib
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.faults import (
    Faults,
    FaultyStore,
    PathReport,
    StoreFaultRates,
    directory_corruptor,
)
from hicache.domain import ConfigError
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus
from hicache.integrations.sglang.backend import HiCacheBackend
from hicache.integrations.sglang.bench import SglangBench, _config, host_pool

SABOTAGE = frozenset({"damage", "hang"})
PAGES = 8  # the longest request; the host pool holds 2 x PAGES pages
GEOMETRY = SglangBench(pages=PAGES, page_size=4, layers=2, heads=2, head_dim=8)
OPS = (("set", 35), ("get", 35), ("exists", 15), ("legacy_set", 8), ("legacy_get", 7))
STORE_FAULTS = StoreFaultRates(
    transient=0.03,
    full=0.02,
    fatal=0.01,
    slow=0.002,
    slow_s=0.01,
    corrupt=0.05,
    stall=0.02,
    stall_s=0.01,
)
DEADLINE_S, GRACE_S = 0.2, 0.2


class _Hanging(FaultyStore):
    """FaultyStore whose first get hangs (ignoring its deadline) until ``release`` is set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.release = threading.Event()
        self._hung = False

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        if not self._hung:
            self._hung = True
            self.faults.note("sabotage_hang")
            self.release.wait(60.0)
        return super().get(keys, buffers, deadline=deadline)


class _Soak:
    def __init__(self, backend: HiCacheBackend, pool: Any, seed: int) -> None:
        self.b = backend
        self.pool = pool
        self.rng = random.Random(seed)
        self.ps = pool.page_size
        self.attempted: set[str] = set()  # keys a set was asked to store
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.samples: list[str] = []
        self.corrupt = 0
        self.checked = 0
        self.flat = pool.kv_buffer.view(-1).view(torch.uint8)

    # ---- requests and bytes ------------------------------------------------------------------
    def keys(self) -> list[str]:
        rng = self.rng
        pages = rng.randint(1, PAGES)
        root, at, branch = rng.randrange(6), rng.randint(0, pages), rng.randrange(3)
        out, prev = [], b"root%d" % root
        for i in range(pages):
            tokens = b"%d" % i if i < at else b"%d-%d" % (i, branch)
            prev = hashlib.sha256(prev + tokens).digest()
            out.append(prev.hex())
        return out

    def pattern(self, key: str) -> torch.Tensor:
        """The flat page of ``key``: bytes from a digest of the key, repeated."""
        seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
        nbytes = self.page_bytes
        raw = (seed * (nbytes // len(seed) + 1))[:nbytes]
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @property
    def page_bytes(self) -> int:
        return int(self.pool.get_data_page(0, flat=True).numel() * self.pool.dtype.itemsize)

    def fill(self, page: int, key: str) -> None:
        flat = self.pattern(key).view(self.pool.dtype)
        self.pool.set_from_flat_data_page(page * self.ps, flat)

    def read(self, page: int) -> bytes:
        flat = self.pool.get_data_page(page * self.ps, flat=True).contiguous()
        return bytes(flat.reshape(-1).view(torch.uint8).numpy())

    def verify(self, keys: Sequence[str], ok: Sequence[bool], got: Sequence[bytes]) -> None:
        if any(ok[i] and not ok[i - 1] for i in range(1, len(ok))):
            self.error("get", f"the Trues are not a leading run: {list(ok)}")
        for key, good, data in zip(keys, ok, got, strict=True):
            if good:
                self.checked += 1
                if key not in self.attempted or data != bytes(self.pattern(key).numpy()):
                    self.corrupt += 1

    def error(self, op: str, what: str) -> None:
        self.errors[op] += 1
        if len(self.samples) < 5:
            self.samples.append(f"sglang {op}: {what[:300]}")

    # ---- operations --------------------------------------------------------------------------
    def one(self) -> None:
        op = self.rng.choices([n for n, _ in OPS], [w for _, w in OPS])[0]
        self.ops[op] += 1
        keys = self.keys()
        try:
            getattr(self, op)(keys)
        except Exception as exc:  # the backend must never raise into SGLang's controller
            self.error(f"{op}: {type(exc).__name__}", f"{type(exc).__name__}: {exc}")

    def set(self, keys: list[str]) -> None:
        for i, key in enumerate(keys):
            self.fill(i, key)
        indices = torch.arange(0, len(keys) * self.ps, dtype=torch.int64)
        self.attempted.update(keys)
        self.b.batch_set_v1(keys, indices)

    def exists(self, keys: list[str]) -> None:
        found = self.b.batch_exists(keys)
        if not 0 <= found <= len(keys):
            self.error("exists", f"batch_exists answered {found} for {len(keys)} keys")

    def get(self, keys: list[str]) -> None:
        n = self.b.batch_exists(keys)
        if not n:
            return
        keys = keys[:n]
        for i in range(n):  # poison the destination: a page not written cannot pass
            self.pool.set_from_flat_data_page(
                (PAGES + i) * self.ps,
                torch.full((self.page_bytes,), 0xA5, dtype=torch.uint8).view(self.pool.dtype),
            )
        indices = torch.arange(PAGES * self.ps, (PAGES + n) * self.ps, dtype=torch.int64)
        ok = self.b.batch_get_v1(keys, indices)
        self.verify(keys, ok, [self.read(PAGES + i) for i in range(n)])

    def legacy_set(self, keys: list[str]) -> None:
        values = [self.pattern(k).view(self.pool.dtype) for k in keys]
        self.attempted.update(keys)  # a False may still have stored some of them
        self.b.batch_set(keys, values)

    def legacy_get(self, keys: list[str]) -> None:
        targets = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = self.b.batch_get(keys, targets)
        ok = [g is not None for g in got]
        data = [
            bytes(g.contiguous().view(torch.uint8).numpy()) if g is not None else b"" for g in got
        ]
        self.verify(keys, ok, data)


def _leaks(backend: HiCacheBackend, root: Path) -> dict[str, int]:
    deadline = time.monotonic() + 2 * (DEADLINE_S + GRACE_S)
    while backend._stuck and time.monotonic() < deadline:
        time.sleep(0.01)
    temps = [p for p in root.rglob("*") if p.is_file() and ".tmp" in p.name]
    return {"stuck_calls": backend._stuck, "temp_files": len(temps)}


def soak_sglang(
    ops: int = 10_000, seed: int = 0, sabotage: frozenset[str] = frozenset()
) -> PathReport:
    """Run the SGLang path of the soak (see the module docstring)."""
    if not sabotage <= SABOTAGE:
        raise ConfigError(
            f"SGLang soak sabotage must be a subset of {sorted(SABOTAGE)}, got {sorted(sabotage)!r}"
        )
    faults = Faults(seed + 23)
    rates = STORE_FAULTS
    if "damage" in sabotage:
        rates = attrs.evolve(rates, damage_read=1.0)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hicache-soak-sglang-") as tmp:
        root = Path(tmp) / "store"
        inner = DirectoryStore(DirectorySettings(root=str(root)))
        kind = _Hanging if "hang" in sabotage else FaultyStore
        store = kind(inner, faults, rates, corrupt=directory_corruptor(root))
        extra = {
            "interface_v1": 1,
            "store": "directory",
            "deadline_s": DEADLINE_S,
            "grace_s": GRACE_S,
        }
        backend = HiCacheBackend(_config(extra), {"store": store})
        try:
            pool = host_pool(GEOMETRY)
            backend.register_mem_pool_host(pool)
            run = _Soak(backend, pool, seed)
            for _ in range(ops):
                run.one()
            leaks = _leaks(backend, root)
        finally:
            if isinstance(store, _Hanging):
                store.release.set()
            backend.close()
    return PathReport(
        path="sglang",
        ops=ops,
        faults=faults.total,
        errors=sum(run.errors.values()),
        leaks=sum(leaks.values()),
        corrupt_pages=run.corrupt,
        checked_pages=run.checked,
        seconds=round(time.perf_counter() - start, 3),
        operations=dict(sorted(run.ops.items())),
        fault_kinds=dict(sorted(faults.counts.items())),
        error_kinds=dict(sorted(run.errors.items())),
        error_samples=run.samples,
        details={"leaks": leaks, "keys_written": len(run.attempted)},
    )


__all__ = ["SABOTAGE", "soak_sglang"]
