"""What the scheduler side asks of the workers each step, and what the workers report back.

- LoadOp: one request's pages to restore: (key, host slot, device block, read from storage first);
  for a hybrid model also the state at the hit's end (StateLoad), all or nothing.
- SaveOp: one full block a step computed, to copy into a host slot (and then to the store).
- StateSave: the recurrent (Mamba / Gated DeltaNet) state of every state group at a block
  boundary a step ended on, to copy into a state slot (and then to the store).
- state_key(key) / is_state(key): a state page's key is its boundary's chain key (the key of the
  block ending there) behind the STATE prefix, so state and KV pages never share a key.
- window_key(key) / is_window(key): a window page (one block of every sliding-window layer, for
  vLLM's hybrid KV cache manager) is keyed by its block's chain key behind the WINDOW prefix.
  Like a state it is one block per vLLM group (StateSave / StateLoad carry either kind).
- StepPlan: a step's loads (synchronous ones feed this step's forward; asynchronous ones run
  between steps), saves and the requests whose asynchronous load the scheduler waits for.
- Event / WorkerEvents: per-page outcomes a worker reports (save, store, read, load; ok or not).
- Agreement: the scheduler's tally of reports: a page op is settled once every rank reported it;
  it succeeded only if every rank's copy did (a hit counts only where every rank has the data).
- store_tier: the storage tier both sides call the store through (every call bounded).

Plain picklable values: they cross process boundaries inside vLLM's metadata objects.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

import attrs

from hicache.domain.keys import page_hex
from hicache.domain.pools import PoolName
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage, BoundedTier
from hicache.engine.storage_settings import StorageTierSettings
from hicache.integrations.vllm.tp_plan import kv_pool, untag

STATE = b"state:"
WINDOW = b"swa:"


def state_key(key: bytes) -> bytes:
    """The key of the state page at the boundary that block ``key`` ends."""
    return STATE + key


def is_state(key: bytes) -> bool:
    return key.startswith(STATE)


def window_key(key: bytes) -> bytes:
    """The key of the window page (sliding-window layers) of block ``key``."""
    return WINDOW + key


def is_window(key: bytes) -> bool:
    return key.startswith(WINDOW)


def store_key(namespace: str, rank: int, page: bytes, ranks: int = 1) -> StoreKey:
    """Rank ``rank`` of ``ranks``' store key of a page: pool ``kv-r<rank>of<ranks>`` or, for a
    state page, ``state-r<rank>``, or for a window page ``swa-r<rank>``, under its chain key's
    hex. A page key tagged with another writer (hicache.integrations.vllm.tp_plan.tagged) names
    that writer's object."""
    kind, writers, src, raw = untag(page)
    if kind == "one":
        return StoreKey(namespace=namespace, pool=kv_pool(src, writers), page_hash=page_hex(raw))
    if is_state(page):
        return StoreKey(
            namespace=namespace, pool=f"state-r{rank}", page_hash=page_hex(page[len(STATE) :])
        )
    if is_window(page):
        return StoreKey(
            namespace=namespace, pool=f"swa-r{rank}", page_hash=page_hex(page[len(WINDOW) :])
        )
    return StoreKey(namespace=namespace, pool=kv_pool(rank, ranks), page_hash=page_hex(page))


# Pages per store call: one call for a request of up to this many blocks (the connector made one
# store call per request before it went through the storage tier).
STORE_BATCH_PAGES = 1024


def store_tier(storage: BoundedStorage, keys: Callable[[bytes], Sequence[StoreKey]]) -> BoundedTier:
    """A bounded storage tier over ``storage`` whose page keys are named by ``keys`` (every
    rank's key on the scheduler, its own rank's on a worker)."""
    settings = StorageTierSettings(
        batch_pages=STORE_BATCH_PAGES, call_deadline_s=storage.settings.deadline_s
    )
    return storage.tier({}, [PoolName.KV], settings, keys=keys)


class Op(enum.Enum):
    SAVE = "save"  # device block -> host slot
    STORE = "store"  # host slot -> store (the slot's pin ends)
    READ = "read"  # store -> host slot
    LOAD = "load"  # host slot -> device block (the slot's pin ends)


@attrs.frozen
class LoadOp:
    req_id: str
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    blocks: tuple[int, ...]
    from_storage: tuple[bool, ...]
    missing: tuple[int, ...] = ()  # blocks promised to vLLM that could not be planned
    # per key: the TP size of the server that stored it (0 or the reader's own: its own objects)
    writers: tuple[int, ...] = ()
    state: StateLoad | None = None  # hybrid: the state at the hit's end
    all_or_nothing: bool = False  # hybrid: any failure fails the request (vLLM recomputes it)
    windows: tuple[StateLoad, ...] = ()  # sliding-window models: the window pages of the hit


@attrs.frozen
class StateLoad:
    """A state (state_key) or a window page (window_key) to load: one block per vLLM group."""

    key: bytes  # state_key(...) of the boundary, or window_key(...) of a block
    slot: int  # state or window host slot
    blocks: tuple[int, ...]  # one block id per state (or sliding-window) group
    from_storage: bool


@attrs.frozen
class StateSave:
    """A state (state_key) or a window page (window_key) to save: one block per vLLM group."""

    req_id: str
    key: bytes  # state_key(...) of the boundary, or window_key(...) of a block
    slot: int
    blocks: tuple[int, ...]  # one block id per state (or sliding-window) group
    store: bool


@attrs.frozen
class SaveOp:
    req_id: str
    key: bytes
    slot: int
    block: int
    store: bool


@attrs.define
class StepPlan:
    loads: list[LoadOp] = attrs.field(factory=list)
    async_loads: list[LoadOp] = attrs.field(factory=list)
    saves: list[SaveOp] = attrs.field(factory=list)
    state_saves: list[StateSave] = attrs.field(factory=list)  # states and window pages


@attrs.frozen
class Event:
    op: Op
    key: bytes
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0  # this page's share of its transfer's time (LOAD, READ, STORE)


@attrs.define
class WorkerEvents:
    """One or more ranks' events of one step (``merge`` concatenates ranks)."""

    events: list[Event] = attrs.field(factory=list)

    def merge(self, other: WorkerEvents) -> WorkerEvents:
        return WorkerEvents(self.events + other.events)


@attrs.define
class Agreement:
    """Tally of per-rank reports; ``add`` returns the ops settled by these events."""

    ranks: int
    _seen: dict[tuple[Op, bytes], list[int]] = attrs.field(factory=dict)

    def add(self, events: Iterable[Event]) -> list[tuple[Op, bytes, bool]]:
        settled: list[tuple[Op, bytes, bool]] = []
        for e in events:
            tally = self._seen.setdefault((e.op, e.key), [0, 0])
            tally[0] += 1
            tally[1] += 0 if e.ok else 1
            if tally[0] >= self.ranks:
                del self._seen[(e.op, e.key)]
                settled.append((e.op, e.key, tally[1] == 0))
        return settled

    @property
    def waiting(self) -> int:
        return len(self._seen)
