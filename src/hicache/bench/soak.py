"""The soak: random cache operations over every stack, with faults, then leak and byte checks.

- SoakSettings: ops, seed, stacks, page size, fault rates, and ``sabotage`` (deliberate bugs
  that show the checks can fail: "misroute" loads, "leak_slots", "leak_pins").
- SoakReport: {"ops", "faults", "leaked_slots", "leaked_pins", "corrupt_pages", "seconds"}
  plus "errors" (typed errors the face raised where it should have served the call; counted,
  the run goes on), the process's CPU seconds, the pages byte-checked, per-operation, per-fault
  and per-error counts.
- run_soak(settings) / soak(settings): one cache (open_cache on the CPU adapters, tiny
  capacities) per stack over a DirectoryStore in a temporary directory wrapped by FaultyStore,
  with FaultyTransfer around the copies; N operations (match + load, insert, prefetch, evict
  device / host, a load or prefetch cancelled mid-flight) on random requests that share
  prefixes; every device page the soak computes holds bytes derived from its page key
  (DevicePatterns), so every page a load restores is checked; at the end, with the caches
  idle: allocator use against the index's placements, pins, and index.validate().
"""

from __future__ import annotations

import random
import resource
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs

from hicache.adapters.page_patterns import DevicePatterns
from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.cache import CacheRuntime, open_cache
from hicache.bootstrap.config import load_model_spec
from hicache.bootstrap.faults import (
    Faults,
    FaultyStore,
    FaultyTransfer,
    PathReport,
    StoreFaultRates,
    directory_corruptor,
)
from hicache.cache.match import CacheMatch
from hicache.cache.values import CacheSettings
from hicache.domain import ConfigError, PlanSettings, PoolName, plan_stack
from hicache.domain.errors import HiCacheError, OutOfSlotsError, TransferError
from hicache.domain.keys import chain_keys
from hicache.domain.ports import Transfer
from hicache.domain.tiers import Tier, WriteSettings
from hicache.domain.validators import positive_int
from hicache.engine.storage_settings import StorageTierSettings

STACKS = {
    "dense": "llama-3.1-8b-instruct",
    "latent": "deepseek-v3",
    "sliding": "gpt-oss-20b",
    "state": "qwen3-next-80b-a3b-instruct",
    "parallel_hybrid": "falcon-h1-7b-instruct",
    "indexer": "minimax-m3",
}
OPS = (
    ("insert", 30),
    ("load", 22),
    ("prefetch", 12),
    ("evict_device", 9),
    ("evict_host", 9),
    ("cancel_load", 10),
    ("cancel_prefetch", 8),
)
STORE_FAULTS = StoreFaultRates(
    transient=0.03, full=0.02, fatal=0.01, slow=0.005, corrupt=0.03, slow_s=0.005
)
HOST_WRITES = ("write_through", "write_back", "write_through_selective")
SABOTAGE = frozenset({"misroute", "leak_slots", "leak_pins"})
KV = PoolName.KV


def _stacks(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, tuple) or not value or any(v not in STACKS for v in value):
        raise ConfigError(f"stacks must be a non-empty tuple of {sorted(STACKS)}, got {value!r}")


def _host_writes(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, tuple) or not value:
        raise ConfigError(f"host_writes must be a non-empty tuple of policies, got {value!r}")
    for policy in value:
        WriteSettings(host=policy)  # a ConfigError names a bad one


def _sabotage(_inst: object, _attr: object, value: object) -> None:
    if not isinstance(value, frozenset) or not value <= SABOTAGE:
        raise ConfigError(f"sabotage must be a frozenset of {sorted(SABOTAGE)}, got {value!r}")


@attrs.frozen(kw_only=True)
class SoakSettings:
    """What a soak runs (see the module docstring); every field is checked."""

    ops: int = attrs.field(default=10_000, validator=positive_int)
    seed: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    stacks: tuple[str, ...] = attrs.field(default=tuple(STACKS), validator=_stacks)
    page_size: int = attrs.field(default=16, validator=positive_int)
    device_pages: int = attrs.field(default=12, validator=positive_int)
    max_pages: int = attrs.field(default=10, validator=positive_int)
    copy_fail_rate: float = 0.02
    store: StoreFaultRates = attrs.field(factory=lambda: STORE_FAULTS)
    sabotage: frozenset[str] = attrs.field(default=frozenset(), validator=_sabotage)
    # Requests in flight at once (1: one operation after another, deterministic for a seed; 4,
    # the default, lets requests race each other in the cache face, docs/bench-soak.md).
    concurrency: int = attrs.field(default=4, validator=positive_int)
    # The host write policy of the i-th stack is host_writes[i % len]; storage: write_through.
    host_writes: tuple[str, ...] = attrs.field(default=HOST_WRITES, validator=_host_writes)


@attrs.frozen(kw_only=True)
class SoakReport:
    ops: int
    faults: int
    leaked_slots: int
    leaked_pins: int
    corrupt_pages: int
    errors: int
    seconds: float
    cpu_seconds: float
    checked_pages: int
    operations: dict[str, int]
    fault_kinds: dict[str, int]
    error_kinds: dict[str, int]
    error_samples: list[str]

    def as_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def as_path(self) -> PathReport:
        """The cache path's part of ``hicache bench soak``'s report (leaks: slots + pins)."""
        return PathReport(
            path="cache",
            ops=self.ops,
            faults=self.faults,
            errors=self.errors,
            leaks=self.leaked_slots + self.leaked_pins,
            corrupt_pages=self.corrupt_pages,
            checked_pages=self.checked_pages,
            seconds=self.seconds,
            operations=self.operations,
            fault_kinds=self.fault_kinds,
            error_kinds=self.error_kinds,
            error_samples=self.error_samples,
            details={
                "leaked_slots": self.leaked_slots,
                "leaked_pins": self.leaked_pins,
                "cpu_seconds": self.cpu_seconds,
            },
        )


class _Stack:
    """One stack's cache runtime and what the soak knows about it."""

    def __init__(self, name: str, rt: CacheRuntime, patterns: DevicePatterns) -> None:
        self.name = name
        self.rt = rt
        self.cache = rt.cache
        self.patterns = patterns
        self.owners = [p.name for p in rt.plan.independent_pools()]
        self.keys: set[bytes] = set()
        self.held: dict[PoolName, list[int]] = {}


class _Soak:
    def __init__(self, settings: SoakSettings, faults: Faults) -> None:
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.faults = faults
        self.ops: Counter[str] = Counter()
        self.corrupt = 0
        self.checked = 0
        self.errors: Counter[str] = Counter()
        self.error_samples: list[str] = []

    # ---- requests ------------------------------------------------------------------------------
    def tokens(self) -> list[int]:
        """A request that shares a prefix with others: root r, branch x from page b on."""
        ps, rng = self.s.page_size, self.rng
        pages = rng.randint(1, self.s.max_pages)
        root, branch_at, branch = rng.randrange(6), rng.randint(0, pages), rng.randrange(3)
        base = 1_000_000 * (root + 1)
        out = [base + j for j in range(branch_at * ps)]
        out += [base + 500_000 + 10_000 * branch + j for j in range(branch_at * ps, pages * ps)]
        return [*out, 7, 8, 9]  # a partial page, never keyed

    # ---- checks --------------------------------------------------------------------------------
    def verify(self, st: _Stack, m: CacheMatch, keys: Sequence[bytes]) -> None:
        for i, where in enumerate(m.placements()):
            for pool, page in where.items():
                self.checked += 1
                if not st.patterns.check(pool, page, keys[i]):
                    self.corrupt += 1

    # ---- operations ----------------------------------------------------------------------------
    async def restore(self, st: _Stack, m: CacheMatch, keys: Sequence[bytes], cancel: bool) -> int:
        """Load the host part of ``m``; the pages usable on the device (-1: cancelled)."""
        cache = st.cache
        if m.host_pages == 0:
            return 0
        try:
            try:
                load = await cache.load(m)
            except OutOfSlotsError:
                await cache.evict(Tier.DEVICE, m.host_pages)
                load = await cache.load(m)
            if cancel:
                await load.wait_layer_ready(self.rng.randrange(st.rt.plan.transfer_layers))
                await load.cancel()
                return -1
            await load.wait()
        except (OutOfSlotsError, TransferError):
            return 0
        self.verify(st, m, keys)
        return m.host_pages

    async def allocate(self, st: _Stack, counts: dict[PoolName, int]) -> dict[PoolName, list[int]]:
        """The framework's device pages for a request, evicting LRU pages first when short."""
        slots = st.rt.runtime.device_slots
        free = slots.free_counts()
        for pool, n in counts.items():
            short = n - free.get(pool, 0)
            if short > 0:
                await st.cache.evict(Tier.DEVICE, short, None if pool is KV else pool)
        return {p: list(v) for p, v in slots.allocate(counts).pages.items()}

    async def insert(self, st: _Stack, tokens: list[int], keys: list[bytes]) -> None:
        cache = st.cache
        with await cache.match(tokens) as m:
            hit = await self.restore(st, m, keys, cancel=False)
            n = len(keys)
            boundaries = cache.checkpoint_boundaries(n, hit)
            counts = {KV: n - hit}
            if PoolName.SWA in st.owners:
                counts[PoolName.SWA] = n - hit
            if PoolName.MAMBA in st.owners:
                counts[PoolName.MAMBA] = len(boundaries)
            counts = {p: c for p, c in counts.items() if c > 0}
            if not counts:
                return
            try:
                ids = await self.allocate(st, counts)
            except OutOfSlotsError:
                self.ops["insert_no_pages"] += 1
                return
            for pool, pages in ids.items():
                if pool is PoolName.MAMBA:
                    for b, slot in zip(boundaries, pages, strict=True):
                        st.patterns.fill(pool, slot, keys[b - 1])
                else:
                    for j, page in enumerate(pages):
                        st.patterns.fill(pool, page, keys[hit + j])
            place = m.placements()[:hit] if hit else []
            device: dict[PoolName, list[int | None]] = {
                KV: [*(w[KV] for w in place), *ids.get(KV, [])]
            }
            if PoolName.SWA in st.owners:
                device[PoolName.SWA] = [w.get(PoolName.SWA) for w in place] + list(
                    ids.get(PoolName.SWA, [])
                )
            checkpoints = {
                b: {PoolName.MAMBA: slot}
                for b, slot in zip(boundaries, ids.get(PoolName.MAMBA, []), strict=True)
            }
            await cache.insert(tokens, device, checkpoints=checkpoints)

    async def load(self, st: _Stack, tokens: list[int], keys: list[bytes], cancel: bool) -> None:
        with await st.cache.match(tokens) as m:
            if m.host_pages == m.device_pages:
                self.verify(st, m, keys)  # a device hit: the pages must still hold their bytes
                return
            await self.restore(st, m, keys, cancel)

    async def prefetch(self, st: _Stack, tokens: list[int], cancel: bool) -> None:
        with await st.cache.match(tokens) as m:
            if m.storage_pages <= m.host_pages:
                return
            if cancel:
                with anyio.move_on_after(self.rng.uniform(0.0, 0.004)):
                    await st.cache.prefetch(m)
            else:
                await st.cache.prefetch(m)

    async def step(self, st: _Stack) -> None:
        names, weights = zip(*OPS, strict=True)
        op = self.rng.choices(names, weights)[0]
        self.ops[op] += 1
        tokens = self.tokens()
        keys = chain_keys(tokens, self.s.page_size)
        st.keys.update(keys)
        try:
            await self._run(st, op, tokens, keys)
        except HiCacheError as e:  # a call the face should have served: counted, not fatal
            self.errors[f"{op}: {type(e).__name__}"] += 1
            if len(self.error_samples) < 5:
                self.error_samples.append(f"{st.name} {op}: {type(e).__name__}: {e}")

    async def _run(self, st: _Stack, op: str, tokens: list[int], keys: list[bytes]) -> None:
        if op == "insert":
            await self.insert(st, tokens, keys)
        elif op in ("load", "cancel_load"):
            await self.load(st, tokens, keys, cancel=op == "cancel_load")
        elif op in ("prefetch", "cancel_prefetch"):
            await self.prefetch(st, tokens, cancel=op == "cancel_prefetch")
        else:
            tier = Tier.DEVICE if op == "evict_device" else Tier.HOST
            pool = self.rng.choice([None, *st.owners[1:]])
            await st.cache.evict(tier, self.rng.randint(1, 6), pool)

    # ---- the end -------------------------------------------------------------------------------
    def final_check(self, st: _Stack) -> tuple[int, int]:
        """(leaked slots, leaked pins) of an idle stack; device pages re-checked byte by byte."""
        cache, rt = st.cache, st.rt
        cache.index.validate()
        leaked = 0
        for tier, slots in (
            (Tier.DEVICE, rt.runtime.device_slots),
            (Tier.HOST, rt.runtime.host_slots),
        ):
            held: dict[PoolName, set[int]] = {p: set() for p in st.owners}
            for key in st.keys:
                where = cache.index.placement(tier, key) or {}
                for pool, page in where.items():
                    if pool in held:
                        held[pool].add(page)
                        if tier is Tier.DEVICE:
                            self.checked += 1
                            self.corrupt += not st.patterns.check(pool, page, key)
            for pool in st.owners:
                leaked += abs(slots.allocator(pool).used_count() - len(held[pool]))
        stats = cache.index.statistics()
        engine = rt.runtime.engine
        pins = (
            stats.pinned.total + stats.in_flight + len(engine.host_pins) + len(engine.device_pins)
        )
        return leaked, pins


def _plan(name: str, s: SoakSettings, host_writes: str) -> tuple[Any, CacheSettings]:
    spec = load_model_spec(STACKS[name])
    plan = plan_stack(
        spec,
        PlanSettings(
            tp_size=8,
            page_size=s.page_size,
            device_tokens=s.device_pages * s.page_size,
            device_slots=4,
        ),
    )
    tier = StorageTierSettings(
        prefetch_policy="timeout",
        timeout_base_s=0.05,
        timeout_per_ki_token_s=0.0,
        timeout_max_s=0.05,
        call_deadline_s=0.05,
        breaker_threshold=5,
        breaker_cooldown_s=0.002,
    )
    settings = CacheSettings(
        writes=WriteSettings(host=host_writes, storage="write_through"),
        sliding_window=spec.sliding_window,
        checkpoints=CacheSettings().checkpoints,
        storage=tier,
    )
    return plan, settings


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


async def soak(settings: SoakSettings) -> SoakReport:
    """Run the soak of ``settings`` (see the module docstring)."""
    faults = Faults(settings.seed + 1)
    run = _Soak(settings, faults)
    start, cpu = time.perf_counter(), _cpu()
    leaked_slots = leaked_pins = 0
    with tempfile.TemporaryDirectory(prefix="hicache-soak-") as tmp:
        stacks: list[_Stack] = []
        opened: list[CacheRuntime] = []
        stores: list[DirectoryStore] = []
        try:
            for i, name in enumerate(settings.stacks):
                policy = settings.host_writes[i % len(settings.host_writes)]
                plan, cache_settings = _plan(name, settings, policy)
                root = Path(tmp) / name
                inner = DirectoryStore(DirectorySettings(root=str(root)))
                stores.append(inner)
                store = FaultyStore(
                    inner, faults, settings.store, corrupt=directory_corruptor(root)
                )

                def wrap(t: Transfer) -> Transfer:
                    return FaultyTransfer(
                        t,
                        faults,
                        fail_rate=settings.copy_fail_rate,
                        misroute_rate=0.05 if "misroute" in settings.sabotage else 0.0,
                    )

                rt = open_cache(
                    plan, backend="torch", settings=cache_settings, store=store, wrap_transfer=wrap
                )
                await rt.__aenter__()
                opened.append(rt)
                stacks.append(_Stack(name, rt, DevicePatterns(rt.runtime.device, plan)))
            for st in stacks:
                if "leak_slots" in settings.sabotage:
                    st.held = {KV: list(st.rt.runtime.device_slots.allocate({KV: 1}).pages[KV])}
            left = [settings.ops]

            async def worker() -> None:
                while left[0] > 0:
                    left[0] -= 1
                    await run.step(run.rng.choice(stacks))

            async with anyio.create_task_group() as tg:
                for _ in range(settings.concurrency):
                    tg.start_soon(worker)
            for st in stacks:
                await st.cache.wait_idle()
                if "leak_pins" in settings.sabotage and st.keys:
                    key = next(
                        k
                        for k in sorted(st.keys)
                        if st.cache.index.placement(Tier.HOST, k)
                        or st.cache.index.placement(Tier.DEVICE, k)
                    )
                    tier = Tier.HOST if st.cache.index.placement(Tier.HOST, key) else Tier.DEVICE
                    st.cache.index.pin(tier, [key])
                slots, pins = run.final_check(st)
                leaked_slots += slots
                leaked_pins += pins
        finally:
            for rt in reversed(opened):
                await rt.aclose()
            for store_ in stores:
                store_.close()
    return SoakReport(
        ops=settings.ops,
        faults=faults.total,
        leaked_slots=leaked_slots,
        leaked_pins=leaked_pins,
        corrupt_pages=run.corrupt,
        errors=sum(run.errors.values()),
        seconds=round(time.perf_counter() - start, 3),
        cpu_seconds=round(_cpu() - cpu, 3),
        checked_pages=run.checked,
        operations=dict(sorted(run.ops.items())),
        fault_kinds=dict(sorted(faults.counts.items())),
        error_kinds=dict(sorted(run.errors.items())),
        error_samples=run.error_samples,
    )


def run_soak(settings: SoakSettings | None = None) -> SoakReport:
    """Run a soak from synchronous code (its own event loop)."""
    return anyio.run(soak, settings if settings is not None else SoakSettings())


__all__ = ["STACKS", "SoakReport", "SoakSettings", "run_soak", "soak"]
