"""The scheduler side's state: its indexes, the store's hint, each request's keys.

SideState is the base of hicache.integrations.vllm.scheduler.SchedulerSide (its constructor and
attributes, shared by the jobs beside it: scheduler_hits, scheduler_loads, scheduler_saves):
the page indexes (KV pages, a hybrid model's state pages, a sliding-window model's window
pages), the bounded store and the writer probe, the load policy, the agreement of the ranks'
reports and each request's keys (computed once each; a request whose extras cannot be keyed is
neither matched nor saved). Scheduled: one request scheduled in a step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from hicache.domain.host_pages import HostPages
from hicache.domain.keys import chain_keys
from hicache.domain.pools import PoolName
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage, BoundedTier
from hicache.engine.logs import get_logger
from hicache.integrations.vllm.block_keys import BlockExtras, UnkeyableError, chain_block_keys
from hicache.integrations.vllm.hybrid_hits import HybridHit, window_pages
from hicache.integrations.vllm.load_policy import LoadPolicy
from hicache.integrations.vllm.plan import Agreement, LoadOp, store_tier
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_plan import TpHeads
from hicache.integrations.vllm.tp_sources import WriterProbe

if TYPE_CHECKING:
    from hicache.integrations.vllm.events import TierEvents

log = get_logger("hicache.vllm")


@attrs.define
class TrackedRequest:
    prompt_len: int
    keys: list[bytes] = attrs.field(factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) were planned (saved or found held)
    extras: BlockExtras | None = None  # None: blocks keyed by their tokens alone
    unkeyable: bool = False  # its extras cannot be keyed: neither matched nor saved


@attrs.define
class Hit:
    start: int  # first block hicache restores (vLLM's own hit ends here)
    host: int  # blocks [start, host) come from host pages
    end: int  # blocks [host, end) come from the store
    state_from_store: bool | None = None  # hybrid: where the state at ``end`` is
    hybrid: HybridHit | None = None  # hybrid: the state's and window pages' places
    writers: tuple[int, ...] = ()  # blocks [host, end): the TP size that stored each


@attrs.frozen
class Scheduled:
    """One request scheduled in a step, as the connector reads it from vLLM's output."""

    req_id: str
    tokens: Sequence[int]  # every token id known so far (prompt and output)
    num_computed: int
    num_scheduled: int


class SideState:
    """What the scheduler side's jobs share (see SchedulerSide)."""

    def __init__(
        self,
        *,
        block_size: int,
        host_slots: int,
        store: BoundedStorage | None,
        store_keys: Callable[[bytes], list[StoreKey]],
        write_storage: bool,
        save_decode: bool,
        ranks: int,
        stats: ConnectorStats,
        state_groups: int = 0,
        state_slots: int = 0,
        events: TierEvents | None = None,
        window_groups: int = 0,
        window_tokens: int = 0,
        window_slots: int = 0,
        null_blocks: bool = False,
        heads: TpHeads | None = None,
        policy: LoadPolicy | None = None,
    ) -> None:
        self.block_size = block_size
        # events: what the tiers hold, as vLLM KV events (hicache.integrations.vllm.events)
        self.events = events
        # load or recompute (hicache.integrations.vllm.load_policy); "always" by default here
        self.policy = policy if policy is not None else LoadPolicy("always", time_steps=False)
        self._declined: dict[str, int] = {}  # req_id -> tokens of its hit not offered
        self.index = HostPages(host_slots, on_change=events.host_change if events else None)
        self.state_groups = state_groups
        self.states = HostPages(state_slots, pool=PoolName.MAMBA) if state_groups else None
        self.window_groups = window_groups
        self.windows = HostPages(window_slots, pool=PoolName.SWA) if window_groups else None
        self.window_size = window_pages(window_tokens, block_size) if window_groups else 0
        # one sliding-window group: block id 0 is vLLM's null block (a freed block)
        self.null_blocks = null_blocks
        # that sliding group beside state groups: a hybrid hit needs only its window's pages
        self.kv_window = (
            window_pages(window_tokens, block_size)
            if null_blocks and window_tokens and state_groups and not window_groups
            else 0
        )
        # exists of every rank's key of a page, each call bounded (a hung store is a miss)
        self.store: BoundedTier | None = (
            store_tier(store, store_keys) if store is not None else None
        )
        self.store_keys = store_keys  # one key per rank
        # pages stored by a server of another TP size (hicache.integrations.vllm.tp_sources)
        self.probe = (
            WriterProbe(self.store, ranks, heads, stats)
            if self.store is not None and heads is not None
            else None
        )
        self.write_storage = write_storage and store is not None
        self.save_decode = save_decode
        self.agreement = Agreement(ranks)
        self.stats = stats
        self._reqs: dict[str, TrackedRequest] = {}
        self._hits: dict[str, Hit] = {}
        self._loads: list[LoadOp] = []
        self._async: list[LoadOp] = []
        # Pages whose read or load failed: not offered again until a save of them succeeds
        # (vLLM reschedules the request at once; offering the same pages would loop).
        self._bad: set[bytes] = set()
        self._hit_tokens = [0, 0]  # host, storage: since the last plan
        self._looked: dict[str, tuple[int, int]] = {}  # req_id -> (prompt tokens, vLLM's hit)
        self._sources: dict[str, tuple[int, int]] = {}  # req_id -> accepted (host, storage)

    # ---- keys ------------------------------------------------------------------------------

    def _keys(
        self, req_id: str, tokens: Sequence[int], blocks: int, prompt_len: int
    ) -> list[bytes]:
        """The keys of the request's first ``blocks`` blocks (computed once each); none when
        the request is unkeyable (then counted once and never matched or saved)."""
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = TrackedRequest(prompt_len)
        have = len(st.keys)
        if blocks > have and not st.unkeyable:
            bs = self.block_size
            prior = st.keys[-1] if st.keys else None
            piece = list(tokens[have * bs : blocks * bs])
            if st.extras is None:
                st.keys.extend(chain_keys(piece, bs, prior=prior))
            else:
                try:
                    digests = st.extras.digests(have, blocks)
                    st.keys.extend(chain_block_keys(piece, bs, digests, prior=prior))
                except UnkeyableError as exc:
                    self._unkeyable(req_id, st, exc)
        return [] if st.unkeyable else st.keys[:blocks]

    def _unkeyable(self, req_id: str, st: TrackedRequest, exc: UnkeyableError) -> None:
        st.unkeyable = True
        self._hits.pop(req_id, None)
        self.stats.add("unkeyable_requests", 1)
        self.stats.error("key", "unkeyable")
        log.warning("vllm.request_not_cached", request=req_id, reason=str(exc))

    def tracked(self) -> int:
        """Requests, hits and queued loads this side still holds (0 once every request ended
        and every plan was built)."""
        return len(self._reqs) + len(self._hits) + len(self._loads) + len(self._async)

    @property
    def hybrid(self) -> bool:
        """State or sliding-window groups: hits need more than the KV pages (all or nothing)."""
        return self.states is not None or self.windows is not None
