"""The scheduler side's load plans: a hit vLLM accepted, turned into a LoadOp.

LoadPlans.after_alloc: once vLLM allocated the request's blocks, pins the host pages, reserves
host slots for the store pages and queues the LoadOp (synchronous when every page is on host;
asynchronous otherwise, and always for a hybrid hit, all or nothing); counts the lookup once
with what is really restored. hit_sources: the accepted tokens split by tier (vLLM's stats).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.domain import CacheStateError
from hicache.integrations.vllm.hybrid_hits import NULL_BLOCK, Taken, give_back, take, take_windows
from hicache.integrations.vllm.plan import LoadOp, StateLoad, state_key
from hicache.integrations.vllm.scheduler_state import SideState


class LoadPlans(SideState):
    """SchedulerSide's load plans (module docstring)."""

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
        into: list[int] = []  # the attention blocks the pages go to
        sliding = hit.hybrid.kv  # a sliding attention group: the window's pages, by source
        for b in range(hit.start, end if ok else hit.start):
            if self.null_blocks and block_ids[b] == NULL_BLOCK:  # outside the window
                continue
            if self.kv_window and b not in sliding:  # vLLM keeps a block hicache has no page of
                ok = False
                break
            from_store = sliding[b] if self.kv_window else b >= hit.host
            slot = take(self.index, keys[b], from_store, taken)
            if slot is None:
                ok = False
                break
            slots.append(slot)
            into.append(block_ids[b])
            if from_store and self.events is not None:
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
        missing = () if ok else block_ids[hit.start : end]
        op = LoadOp(
            req_id=req_id,
            keys=tuple(t[1] for t in pages),
            slots=tuple(slots[: len(pages)]),
            blocks=tuple(into[: len(pages)]),
            from_storage=tuple(t[2] for t in pages),
            missing=tuple(b for b in missing if not (self.null_blocks and b == NULL_BLOCK)),
            state=state,
            all_or_nothing=True,
            windows=tuple(windows or ()),
        )
        self._async.append(op)
        if not ok:
            return 0, 0
        # the tokens restored: every block of the hit (the null blocks before a sliding
        # attention group's window need no page: vLLM's model reads none of them)
        host_blocks = min(end, hit.host) - hit.start
        self._hit_tokens[0] += host_blocks * self.block_size
        self._hit_tokens[1] += (end - hit.start - host_blocks) * self.block_size
        return host_blocks, end - hit.start - host_blocks

    def hit_sources(self, req_id: str, num_external: int) -> tuple[int, int]:
        """How many of the ``num_external`` tokens vLLM accepted for ``req_id`` were planned
        from the host tier and how many from the store (they sum to ``num_external``); a
        request without an accepted hit counts as the store's (the outermost tier)."""
        host, _ = self._sources.pop(req_id, (0, 0))
        host = min(max(host, 0), max(num_external, 0))
        return host, max(num_external, 0) - host
