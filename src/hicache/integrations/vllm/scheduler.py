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

The jobs, one module each (SchedulerSide is all of them over one state): scheduler_state
(SideState: the constructor, the indexes, each request's keys; Scheduled), scheduler_hits
(HitLookup.match), scheduler_loads (LoadPlans.after_alloc, hit_sources), scheduler_saves
(SavePlans.build); this module settles the workers' reports (on_events) and a request's end.

Where things live: this object (in vLLM's scheduler process) owns the page index, the
namespace of store keys and the host slot numbers; the worker owns the host memory and the
copies (docs/vllm.md, "Processes").
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.domain.host_pages import HostPages
from hicache.integrations.vllm.plan import Event, Op, is_state, is_window
from hicache.integrations.vllm.scheduler_hits import HitLookup
from hicache.integrations.vllm.scheduler_loads import LoadPlans
from hicache.integrations.vllm.scheduler_saves import SavePlans
from hicache.integrations.vllm.scheduler_state import Scheduled

__all__ = ["Scheduled", "SchedulerSide"]


class SchedulerSide(HitLookup, LoadPlans, SavePlans):
    """The scheduler side (module docstring): the jobs beside it, and the workers' reports."""

    # ---- the workers' reports --------------------------------------------------------------

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
