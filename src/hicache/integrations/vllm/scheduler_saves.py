"""The scheduler side's step plan: the queued loads and the step's saves.

SavePlans.build: the StepPlan of one step: the loads queued since the last one, and a SaveOp for
every block that becomes full in this step (prompt and, with save_decode, decode blocks) and
whose page the host tier does not hold yet; a hybrid model's state at a boundary where the step
ended, and a sliding-window model's window pages while vLLM still holds their blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hicache.integrations.vllm.hybrid_hits import NULL_BLOCK, window_saves
from hicache.integrations.vllm.plan import SaveOp, StateSave, StepPlan, state_key
from hicache.integrations.vllm.scheduler_state import Scheduled, SideState, TrackedRequest


class SavePlans(SideState):
    """SchedulerSide's step plans (module docstring)."""

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
        st: TrackedRequest,
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
