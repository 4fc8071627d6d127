"""The scheduler side's lookups: how much of a prompt hicache restores, and from where.

HitLookup.match: the hit beyond vLLM's own (whole blocks, never the prompt's last token): host
pages first, then the leading run the store holds (at this TP size or another, through the
writer probe), cut where the load policy declines the rest; a hybrid model's hit ends at a
state or window boundary (hicache.integrations.vllm.hybrid_hits) and is all or nothing. The hit
is kept until vLLM allocates its blocks (hicache.integrations.vllm.scheduler_loads).
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.integrations.vllm.block_keys import BlockExtras
from hicache.integrations.vllm.hybrid_hits import match_hybrid
from hicache.integrations.vllm.scheduler_state import Hit, SideState, TrackedRequest


class HitLookup(SideState):
    """SchedulerSide's lookups (module docstring)."""

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
            st = self._reqs[req_id] = TrackedRequest(len(prompt))
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
        self._hits[req_id] = Hit(
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
            kv_window=self.kv_window,
        )
        if hit is None:
            return 0, False
        # all or nothing (a hybrid hit ends at a state or a window): declined whole if not worth it
        if self._offer(req_id, start, min(max(hit.host, start), hit.end), hit.end) < hit.end:
            self._declined[req_id] = (hit.end - start) * self.block_size
            return 0, False
        self._hits[req_id] = Hit(
            start=start,
            host=hit.host,
            end=hit.end,
            state_from_store=hit.state_from_store,
            hybrid=hit,
        )
        return (hit.end - start) * self.block_size, True
