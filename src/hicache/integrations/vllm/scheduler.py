"""The scheduler side's decisions: hits, load plans and save plans (no vLLM import, no torch).

- SchedulerSide.match(req_id, prompt, num_computed, extras): how many tokens beyond vLLM's own
  hit hicache restores (whole blocks, never the prompt's last token) and whether asynchronously
  (any page in the store: it is read between steps without blocking other requests).
  ``extras`` (hicache.integrations.vllm.block_keys.BlockExtras, None: tokens alone) gives each
  block's extra keys (LoRA, multimodal items, cache_salt, prompt embeddings), chained into the
  page keys; a request whose extras cannot be encoded (UnkeyableError) is neither matched nor
  saved, and counted (``unkeyable_requests``).
- after_alloc(req_id, block_ids, num_external): pins the host pages, reserves host slots for
  the store pages, and queues the LoadOp of the blocks vLLM allocated.
- build(steps, block_ids_of): the StepPlan of one step: the queued loads, and a SaveOp for
  every block that becomes full in this step (prompt and, with save_decode, decode blocks) and
  whose page the host tier does not hold yet.
- on_events(events): applies the workers' reports once every rank reported (Agreement): a
  saved page becomes a hit, a failed one is forgotten; loads and store writes unpin their slot.

Hybrid models (``state_groups`` > 0: Mamba / Gated DeltaNet state beside one attention group)
keep a second index of state pages: a state exists only at a boundary where a step ended
(vLLM's "align" mode writes it into the state groups' block there), so a hit ends at the
deepest boundary up to which every KV block and that boundary's state are held (host or store),
and it is always loaded asynchronously, all or nothing: vLLM's model runner copies the state
from the hit's last block into the running one before the forward, which a load started in the
step itself would be too late for, and vLLM recovers a failed hybrid load by recomputing the
whole request (``failed_recving``), not by block.

Sliding-window models under vLLM's hybrid KV cache manager (``window_groups`` > 0) keep a
third index of window pages (one block of every sliding layer per block, saved while vLLM still
holds it); a hit also needs the window pages of the blocks before its boundary that vLLM keeps
for the sliding groups (hicache.integrations.vllm.hybrid_hits: the rule, one for states and
windows), and is loaded like a state hit: asynchronously, all or nothing.

Where things live: this object (in vLLM's scheduler process) owns the page index, the
namespace of store keys and the host slot numbers; the worker owns the host memory and the
copies (docs/vllm.md, "Processes").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs

from hicache.domain import CacheStateError
from hicache.domain.host_pages import HostPages
from hicache.domain.keys import chain_keys
from hicache.domain.pools import PoolName
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage, BoundedTier
from hicache.engine.logs import get_logger
from hicache.integrations.vllm.block_keys import BlockExtras, UnkeyableError, chain_block_keys
from hicache.integrations.vllm.hybrid_hits import (
    NULL_BLOCK,
    HybridHit,
    Taken,
    give_back,
    match_hybrid,
    take,
    take_windows,
    window_pages,
    window_saves,
)
from hicache.integrations.vllm.load_policy import LoadPolicy
from hicache.integrations.vllm.plan import (
    Agreement,
    Event,
    LoadOp,
    Op,
    SaveOp,
    StateLoad,
    StateSave,
    StepPlan,
    is_state,
    is_window,
    state_key,
    store_tier,
)
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_plan import TpHeads
from hicache.integrations.vllm.tp_sources import WriterProbe

if TYPE_CHECKING:
    from hicache.integrations.vllm.events import TierEvents

log = get_logger("hicache.vllm")


@attrs.define
class _Request:
    prompt_len: int
    keys: list[bytes] = attrs.field(factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) were planned (saved or found held)
    extras: BlockExtras | None = None  # None: blocks keyed by their tokens alone
    unkeyable: bool = False  # its extras cannot be keyed: neither matched nor saved


@attrs.define
class _Hit:
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


class SchedulerSide:
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
        self._reqs: dict[str, _Request] = {}
        self._hits: dict[str, _Hit] = {}
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
            st = self._reqs[req_id] = _Request(prompt_len)
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

    def _unkeyable(self, req_id: str, st: _Request, exc: UnkeyableError) -> None:
        st.unkeyable = True
        self._hits.pop(req_id, None)
        self.stats.add("unkeyable_requests", 1)
        self.stats.error("key", "unkeyable")
        log.warning("vllm.request_not_cached", request=req_id, reason=str(exc))

    # ---- hits ------------------------------------------------------------------------------

    def match(
        self,
        req_id: str,
        prompt: Sequence[int],
        num_computed: int,
        extras: BlockExtras | None = None,
    ) -> tuple[int, bool]:
        bs = self.block_size
        limit = (len(prompt) - 1) // bs  # at least one token stays for vLLM to compute
        start = num_computed // bs
        self._hits.pop(req_id, None)
        self._looked[req_id] = (len(prompt), min(num_computed, len(prompt)))
        st = self._reqs.get(req_id)
        if st is None:  # saved later even when nothing is hit now
            st = self._reqs[req_id] = _Request(len(prompt))
        # The latest reader of the request's extras (a streaming session's later items).
        st.extras = extras
        if limit <= start or st.unkeyable or self.policy.mode == "never":  # never: no lookup
            return 0, False
        keys = self._keys(req_id, prompt, limit, len(prompt))
        if not keys:  # unkeyable
            return 0, False
        if self.hybrid:
            return self._match_hybrid(req_id, keys, start, limit)
        i = start  # blocks before start are vLLM's own hit: hicache need not hold them
        bad = self._bad
        writers: tuple[int, ...] = ()
        while i < limit and keys[i] not in bad and self.index.lookup(keys[i]) is not None:
            i += 1
        host = i
        if self.store is not None and i < limit:
            run = 0
            while (
                i + run < limit and keys[i + run] not in bad and not self.index.known(keys[i + run])
            ):
                run += 1
            if run and self.probe is not None:  # at this TP size or another
                found, answered = self.probe.leading(keys[i : i + run])
                writers = tuple(found)
                if answered and self.events is not None:
                    self.events.store_answer(req_id, i, keys[i : i + run], len(writers))
                i += len(writers)
            elif run:
                answer = self.store.exists(keys[i : i + run])  # the leading run every rank has
                if not answer.answered:
                    self.stats.error("exists", answer.outcome.value)
                elif self.events is not None:
                    self.events.store_answer(req_id, i, keys[i : i + run], answer.value)
                i += answer.value
        end = self._offer(req_id, start, host, i)
        if end <= start:
            return 0, False
        self._hits[req_id] = _Hit(
            start=start, host=min(max(host, start), end), end=end, writers=writers
        )
        return (end - start) * bs, end > max(host, start)

    def _offer(self, req_id: str, start: int, host: int, end: int) -> int:
        """The end of the hit worth loading (LoadPolicy); the rest is declined (recomputed)."""
        self._declined.pop(req_id, None)
        if end <= start:
            return end
        chosen = self.policy.choose(
            start=start, host_end=max(host, start), end=end, block_size=self.block_size
        )
        if chosen < end:
            self._declined[req_id] = (end - chosen) * self.block_size
        return chosen

    def _in_store(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether every rank's copy of each page is in the store (False where it cannot say)."""
        if self.store is None or not keys:
            return [False] * len(keys)
        answer = self.store.exists_each(keys)
        if not answer.answered:
            self.stats.error("exists", answer.outcome.value)
        return answer.value

    @property
    def hybrid(self) -> bool:
        """State or sliding-window groups: hits need more than the KV pages (all or nothing)."""
        return self.states is not None or self.windows is not None

    def _match_hybrid(
        self, req_id: str, keys: Sequence[bytes], start: int, limit: int
    ) -> tuple[int, bool]:
        hit = match_hybrid(
            keys,
            start,
            limit,
            index=self.index,
            states=self.states,
            windows=self.windows,
            window_size=self.window_size,
            bad=self._bad,
            in_store=self._in_store,
        )
        if hit is None:
            return 0, False
        # all or nothing (a hybrid hit ends at a state or a window): declined whole if not worth it
        if self._offer(req_id, start, min(max(hit.host, start), hit.end), hit.end) < hit.end:
            self._declined[req_id] = (hit.end - start) * self.block_size
            return 0, False
        self._hits[req_id] = _Hit(
            start=start,
            host=hit.host,
            end=hit.end,
            state_from_store=hit.state_from_store,
            hybrid=hit,
        )
        return (hit.end - start) * self.block_size, True

    def after_alloc(
        self,
        req_id: str,
        block_ids: Sequence[int],
        num_external: int,
        state_blocks: Sequence[Sequence[int]] = (),
        window_blocks: Sequence[Sequence[int]] = (),
    ) -> None:
        """vLLM allocated the request's blocks (``num_external``: the tokens it accepted from
        match; ``block_ids``: the attention group's, ``state_blocks``: each state group's, for
        a hybrid model, ``window_blocks``: each sliding-window group's); counts the request's
        lookup once, with what hicache really restores."""
        hit = self._hits.get(req_id)
        if hit is not None and num_external > 0:
            n = num_external // self.block_size
            on_host = max(0, min(hit.start + n, hit.host) - hit.start) * self.block_size
            self._sources[req_id] = (min(on_host, num_external), num_external - on_host)
        if self.hybrid:
            host, storage = self._alloc_hybrid(
                req_id, block_ids, num_external, state_blocks, window_blocks
            )
        else:
            host, storage = self._alloc(req_id, block_ids, num_external)
        self.stats.add("declined_tokens", self._declined.pop(req_id, 0))
        self.policy.planned(host=host + storage, reads=storage)
        looked = self._looked.pop(req_id, None)
        if looked is not None:
            tokens, device = looked
            restored = (host + storage) * self.block_size
            self.stats.lookup(
                tokens=tokens,
                device=min(device, tokens - restored),  # vLLM's hit is whole blocks: no-op
                host=host * self.block_size,
                storage=storage * self.block_size,
            )

    def _alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> tuple[int, int]:
        hit = self._hits.pop(req_id, None)
        if num_external <= 0 or hit is None:
            return 0, 0
        n = num_external // self.block_size
        end = min(hit.start + n, hit.end)
        keys = self._reqs[req_id].keys
        picked: list[tuple[bytes, int, int, bool, int]] = []
        missing: list[int] = []
        for b in range(hit.start, end):
            if self.null_blocks and block_ids[b] == NULL_BLOCK:  # outside the window
                continue
            key = keys[b]
            try:
                if b < hit.host:
                    slot: int | None = self.index.pin(key)
                else:
                    slot = None if self.index.known(key) else self.index.reserve(key, pins=1)
            except CacheStateError:
                slot = None
            if slot is None or missing:
                missing.append(block_ids[b])
                continue
            at = b - hit.host
            writer = hit.writers[at] if 0 <= at < len(hit.writers) else 0
            if b >= hit.host and self.events is not None:  # read into the host tier
                self.events.planned(req_id, b, key)
            picked.append((key, slot, block_ids[b], b >= hit.host, writer))
        missing.extend(block_ids[end : hit.start + n])
        op = LoadOp(
            req_id=req_id,
            keys=tuple(p[0] for p in picked),
            slots=tuple(p[1] for p in picked),
            blocks=tuple(p[2] for p in picked),
            from_storage=tuple(p[3] for p in picked),
            missing=tuple(missing),
            writers=tuple(p[4] for p in picked) if hit.writers else (),
        )
        host_blocks = sum(1 for p in picked if not p[3])
        self._hit_tokens[0] += host_blocks * self.block_size
        self._hit_tokens[1] += (len(picked) - host_blocks) * self.block_size
        (self._async if hit.end > hit.host else self._loads).append(op)
        return host_blocks, len(picked) - host_blocks

    def _alloc_hybrid(
        self,
        req_id: str,
        block_ids: Sequence[int],
        num_external: int,
        state_blocks: Sequence[Sequence[int]],
        window_blocks: Sequence[Sequence[int]],
    ) -> tuple[int, int]:
        hit = self._hits.pop(req_id, None)
        if num_external <= 0 or hit is None or hit.hybrid is None:
            return 0, 0
        end = hit.start + num_external // self.block_size
        keys = self._reqs[req_id].keys
        taken: Taken = []
        ok = (
            end == hit.end
            and len(state_blocks) == self.state_groups
            and len(window_blocks) == self.window_groups
        )
        slots: list[int] = []
        for b in range(hit.start, end if ok else hit.start):
            slot = take(self.index, keys[b], b >= hit.host, taken)
            if slot is None:
                ok = False
                break
            slots.append(slot)
            if b >= hit.host and self.events is not None:
                self.events.planned(req_id, b, keys[b])
        windows: list[StateLoad] | None = []
        if ok and self.windows is not None:
            windows = take_windows(
                self.windows, keys, hit.hybrid, hit.start, end, window_blocks, taken
            )
            ok = windows is not None
        state: StateLoad | None = None
        if ok and self.states is not None:
            skey = state_key(keys[end - 1])
            sslot = take(self.states, skey, bool(hit.state_from_store), taken)
            blocks = tuple(ids[end - 1] for ids in state_blocks)
            if sslot is not None:
                state = StateLoad(skey, sslot, blocks, bool(hit.state_from_store))
            ok = state is not None
        pages = [t for t in taken if t[0] is self.index]
        if not ok:  # nothing is loaded: give back what was taken; vLLM recomputes
            give_back(taken)
            pages, windows, state = [], [], None
        op = LoadOp(
            req_id=req_id,
            keys=tuple(t[1] for t in pages),
            slots=tuple(slots[: len(pages)]),
            blocks=tuple(block_ids[hit.start : hit.start + len(pages)]),
            from_storage=tuple(t[2] for t in pages),
            missing=() if ok else tuple(block_ids[hit.start : end]),
            state=state,
            all_or_nothing=True,
            windows=tuple(windows or ()),
        )
        self._async.append(op)
        if not ok:
            return 0, 0
        host_blocks = sum(1 for t in pages if not t[2])
        self._hit_tokens[0] += host_blocks * self.block_size
        self._hit_tokens[1] += (len(pages) - host_blocks) * self.block_size
        return host_blocks, len(pages) - host_blocks

    def hit_sources(self, req_id: str, num_external: int) -> tuple[int, int]:
        """How many of the ``num_external`` tokens vLLM accepted for ``req_id`` were planned
        from the host tier and how many from the store (they sum to ``num_external``); a
        request without an accepted hit counts as the store's (the outermost tier)."""
        host, _ = self._sources.pop(req_id, (0, 0))
        host = min(max(host, 0), max(num_external, 0))
        return host, max(num_external, 0) - host

    # ---- one step ------------------------------------------------------------------------

    def build(
        self,
        steps: Sequence[Scheduled],
        block_ids_of: Callable[[str], Sequence[int]],
        state_ids_of: Callable[[str], Sequence[Sequence[int]]] | None = None,
        window_ids_of: Callable[[str], Sequence[Sequence[int]]] | None = None,
    ) -> StepPlan:
        """The step's plan; ``block_ids_of``: a request's attention blocks, ``state_ids_of``:
        its state groups' blocks (hybrid models), ``window_ids_of``: its sliding-window groups'
        blocks (sliding-window models)."""
        self.policy.step_built((s.num_computed, s.num_scheduled) for s in steps)
        host, storage = self._hit_tokens
        plan = StepPlan(loads=self._loads, async_loads=self._async)
        self._loads, self._async, self._hit_tokens = [], [], [0, 0]
        # counted here only: vLLM adds these stats to the workers' (get_kv_connector_stats)
        self.stats.add("hit_tokens_host", host)
        self.stats.add("hit_tokens_storage", storage)
        bs = self.block_size
        pins = 2 if self.write_storage else 1
        for s in steps:
            st = self._reqs.get(s.req_id)
            if st is None or st.unkeyable:
                continue
            upto = len(s.tokens) if self.save_decode else st.prompt_len
            if self.states is not None and state_ids_of is not None:
                self._save_state(plan, s, st, upto, state_ids_of, pins)
            full = min(s.num_computed + s.num_scheduled, upto) // bs
            if full <= st.saved_upto:
                continue
            keys = self._keys(s.req_id, s.tokens, full, st.prompt_len)
            if not keys:  # unkeyable
                continue
            blocks = block_ids_of(s.req_id)
            for b in range(st.saved_upto, min(full, len(blocks))):
                key = keys[b]
                if self.index.known(key) or (self.null_blocks and blocks[b] == NULL_BLOCK):
                    continue  # held already, or freed by vLLM (one sliding-window group)
                slot = self.index.reserve(key, pins=pins)
                if slot is None:  # every host page is pinned: this block is not saved
                    self.stats.add("save_errors", 1)
                    self.stats.error("save", "host_full")
                    continue
                plan.saves.append(SaveOp(s.req_id, key, slot, blocks[b], self.write_storage))
                if self.events is not None:
                    self.events.planned(s.req_id, b, key)
            if self.windows is not None and window_ids_of is not None:
                self._save_windows(plan, s.req_id, keys, st.saved_upto, full, window_ids_of, pins)
            st.saved_upto = full
        stored = sum(1 for op in plan.saves if op.store)
        self.policy.planned(writes=stored + sum(1 for op in plan.state_saves if op.store))
        return plan

    def _save_state(
        self,
        plan: StepPlan,
        s: Scheduled,
        st: _Request,
        upto: int,
        state_ids_of: Callable[[str], Sequence[Sequence[int]]],
        pins: int,
    ) -> None:
        """A step that ends on a block boundary leaves the state there in the state groups'
        block of that boundary (vLLM's align mode): save it once, like a full block."""
        states = self.states
        assert states is not None
        end = s.num_computed + s.num_scheduled
        j = end // self.block_size
        if end % self.block_size or end > upto or j < 1:
            return
        keys = self._keys(s.req_id, s.tokens, j, st.prompt_len)
        if not keys:  # unkeyable
            return
        skey = state_key(keys[j - 1])
        if states.known(skey):
            return
        groups = state_ids_of(s.req_id)
        blocks = tuple(ids[j - 1] if len(ids) >= j else 0 for ids in groups)
        if len(blocks) != self.state_groups or 0 in blocks:  # 0: vLLM's null block
            return
        slot = states.reserve(skey, pins=pins)
        if slot is None:
            self.stats.add("save_errors", 1)
            self.stats.error("save", "host_full")
            return
        plan.state_saves.append(StateSave(s.req_id, skey, slot, blocks, self.write_storage))

    def _save_windows(
        self,
        plan: StepPlan,
        req_id: str,
        keys: Sequence[bytes],
        first: int,
        stop: int,
        window_ids_of: Callable[[str], Sequence[Sequence[int]]],
        pins: int,
    ) -> None:
        """The window pages of the blocks that became full, while vLLM holds their blocks."""
        windows = self.windows
        assert windows is not None
        for key, blocks in window_saves(windows, keys, first, stop, window_ids_of(req_id)):
            slot = windows.reserve(key, pins=pins)
            if slot is None:
                self.stats.add("save_errors", 1)
                self.stats.error("save", "host_full")
                continue
            plan.state_saves.append(StateSave(req_id, key, slot, blocks, self.write_storage))

    def _index(self, key: bytes) -> HostPages:
        if is_state(key) and self.states is not None:
            return self.states
        if is_window(key) and self.windows is not None:
            return self.windows
        return self.index

    def on_events(self, events: Sequence[Event]) -> None:
        self.policy.observe(events)
        for op, key, ok in self.agreement.add(events):
            self.policy.planned(
                host=-(op is Op.LOAD), reads=-(op is Op.READ), writes=-(op is Op.STORE)
            )
            index = self._index(key)
            if op is Op.SAVE:
                (index.ready if ok else index.drop)(key)
                index.unpin(key)
                if ok:
                    self._bad.discard(key)
            elif op is Op.READ:
                (index.ready if ok else index.drop)(key)
                if not ok:
                    self._bad.add(key)
            else:  # LOAD and STORE end the pin their plan took
                index.unpin(key)
                if op is Op.STORE and ok and self.events is not None:
                    self.events.stored(key)
                if op is Op.LOAD and not ok:
                    self._bad.add(key)

    def finished(self, req_id: str) -> None:
        self.policy.step_ended()  # vLLM frees a request as it processes a step's output
        self._declined.pop(req_id, None)
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._looked.pop(req_id, None)
        self._sources.pop(req_id, None)
