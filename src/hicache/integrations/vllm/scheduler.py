"""The scheduler side's decisions: hits, load plans and save plans (no vLLM import, no torch).

- SchedulerSide.match(req_id, prompt, num_computed): how many tokens beyond vLLM's own hit
  hicache restores (whole blocks, never the prompt's last token) and whether asynchronously
  (any page in the store: it is read between steps without blocking other requests).
- after_alloc(req_id, block_ids, num_external): pins the host pages, reserves host slots for
  the store pages, and queues the LoadOp of the blocks vLLM allocated.
- build(steps, block_ids_of): the StepPlan of one step: the queued loads, and a SaveOp for
  every block that becomes full in this step (prompt and, with save_decode, decode blocks) and
  whose page the host tier does not hold yet.
- on_events(events): applies the workers' reports once every rank reported (Agreement): a
  saved page becomes a hit, a failed one is forgotten; loads and store writes unpin their slot.

Where things live: this object (in vLLM's scheduler process) owns the page index, the
namespace of store keys and the host slot numbers; the worker owns the host memory and the
copies (docs/vllm.md, "Processes").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from hicache.domain import CacheStateError
from hicache.domain.keys import chain_keys
from hicache.domain.storage import Store, StoreKey
from hicache.integrations.vllm.host_index import HostIndex
from hicache.integrations.vllm.plan import Agreement, Event, LoadOp, Op, SaveOp, StepPlan
from hicache.integrations.vllm.stats import ConnectorStats


@attrs.define
class _Request:
    prompt_len: int
    keys: list[bytes] = attrs.field(factory=list)
    saved_upto: int = 0  # blocks [0, saved_upto) were planned (saved or found held)


@attrs.define
class _Hit:
    start: int  # first block hicache restores (vLLM's own hit ends here)
    host: int  # blocks [start, host) come from host pages
    end: int  # blocks [host, end) come from the store


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
        store: Store | None,
        store_keys: Callable[[bytes], list[StoreKey]],
        write_storage: bool,
        save_decode: bool,
        ranks: int,
        stats: ConnectorStats,
    ) -> None:
        self.block_size = block_size
        self.index = HostIndex(host_slots)
        self.store = store
        self.store_keys = store_keys  # one key per rank
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

    # ---- keys ------------------------------------------------------------------------------

    def _keys(
        self, req_id: str, tokens: Sequence[int], blocks: int, prompt_len: int
    ) -> list[bytes]:
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _Request(prompt_len)
        have = len(st.keys)
        if blocks > have:
            bs = self.block_size
            prior = st.keys[-1] if st.keys else None
            st.keys.extend(chain_keys(list(tokens[have * bs : blocks * bs]), bs, prior=prior))
        return st.keys[:blocks]

    # ---- hits ------------------------------------------------------------------------------

    def match(self, req_id: str, prompt: Sequence[int], num_computed: int) -> tuple[int, bool]:
        bs = self.block_size
        limit = (len(prompt) - 1) // bs  # at least one token stays for vLLM to compute
        start = num_computed // bs
        self._hits.pop(req_id, None)
        self._looked[req_id] = (len(prompt), min(num_computed, len(prompt)))
        if req_id not in self._reqs:  # saved later even when nothing is hit now
            self._reqs[req_id] = _Request(len(prompt))
        if limit <= start:
            return 0, False
        keys = self._keys(req_id, prompt, limit, len(prompt))
        i = 0
        bad = self._bad
        while i < limit and keys[i] not in bad and self.index.lookup(keys[i]) is not None:
            i += 1
        host = i
        if self.store is not None and i < limit:
            run = 0
            while (
                i + run < limit and keys[i + run] not in bad and not self.index.known(keys[i + run])
            ):
                run += 1
            if run:
                ask = [k for key in keys[i : i + run] for k in self.store_keys(key)]
                try:
                    there = self.store.exists(ask)
                except Exception as exc:
                    self.stats.error("exists", type(exc).__name__)
                    there = [False] * len(ask)
                per = len(ask) // run
                for j in range(run):
                    if not all(there[j * per : (j + 1) * per]):
                        run = j
                        break
                i += run
        end = i
        if end <= start:
            return 0, False
        self._hits[req_id] = _Hit(start=start, host=max(host, start), end=end)
        return (end - start) * bs, end > max(host, start)

    def after_alloc(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated the request's blocks (``num_external``: the tokens it accepted from
        match); counts the request's lookup once, with what hicache really restores."""
        host, storage = self._alloc(req_id, block_ids, num_external)
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
        picked: list[tuple[bytes, int, int, bool]] = []
        missing: list[int] = []
        for b in range(hit.start, end):
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
            picked.append((key, slot, block_ids[b], b >= hit.host))
        missing.extend(block_ids[end : hit.start + n])
        op = LoadOp(
            req_id=req_id,
            keys=tuple(p[0] for p in picked),
            slots=tuple(p[1] for p in picked),
            blocks=tuple(p[2] for p in picked),
            from_storage=tuple(p[3] for p in picked),
            missing=tuple(missing),
        )
        host_blocks = sum(1 for p in picked if not p[3])
        self._hit_tokens[0] += host_blocks * self.block_size
        self._hit_tokens[1] += (len(picked) - host_blocks) * self.block_size
        (self._async if hit.end > hit.host else self._loads).append(op)
        return host_blocks, len(picked) - host_blocks

    # ---- one step ------------------------------------------------------------------------

    def build(
        self, steps: Sequence[Scheduled], block_ids_of: Callable[[str], Sequence[int]]
    ) -> StepPlan:
        host, storage = self._hit_tokens
        plan = StepPlan(
            loads=self._loads,
            async_loads=self._async,
            hit_tokens_host=host,
            hit_tokens_storage=storage,
        )
        self._loads, self._async, self._hit_tokens = [], [], [0, 0]
        self.stats.add("hit_tokens_host", host)
        self.stats.add("hit_tokens_storage", storage)
        bs = self.block_size
        pins = 2 if self.write_storage else 1
        for s in steps:
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            upto = len(s.tokens) if self.save_decode else st.prompt_len
            full = min(s.num_computed + s.num_scheduled, upto) // bs
            if full <= st.saved_upto:
                continue
            keys = self._keys(s.req_id, s.tokens, full, st.prompt_len)
            blocks = block_ids_of(s.req_id)
            for b in range(st.saved_upto, min(full, len(blocks))):
                key = keys[b]
                if self.index.known(key):
                    continue
                slot = self.index.reserve(key, pins=pins)
                if slot is None:  # every host page is pinned: this block is not saved
                    self.stats.add("save_errors", 1)
                    self.stats.error("save", "host_full")
                    continue
                plan.saves.append(SaveOp(s.req_id, key, slot, blocks[b], self.write_storage))
            st.saved_upto = full
        return plan

    def on_events(self, events: Sequence[Event]) -> None:
        for op, key, ok in self.agreement.add(events):
            if op is Op.SAVE:
                (self.index.ready if ok else self.index.drop)(key)
                self.index.unpin(key)
                if ok:
                    self._bad.discard(key)
            elif op is Op.READ:
                (self.index.ready if ok else self.index.drop)(key)
                if not ok:
                    self._bad.add(key)
            else:  # LOAD and STORE end the pin their plan took
                self.index.unpin(key)
                if op is Op.LOAD and not ok:
                    self._bad.add(key)

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._hits.pop(req_id, None)
        self._looked.pop(req_id, None)
