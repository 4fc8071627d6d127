"""Load or recompute, per request: the scheduler side's measurements and its choice.

- LoadPolicy(mode, clock): ``mode`` is the ``load_policy`` setting: "measured" (offer vLLM only
  the prefix of a hit that loads faster than it computes), "always" (every hit, the connector's
  behaviour before this policy) or "never" (no hit is offered; pages are still saved: a baseline).
- What it measures (docs/vllm.md, "Load or recompute"):
  * per tier, seconds per page from the workers' reports: every LOAD event (host -> device copy)
    and READ event (store -> host read) carries its share of the transfer's seconds
    (hicache.integrations.vllm.plan.Event.seconds), averaged per report (EWMA);
  * per tier, the work already queued: host pages planned for loading and not yet loaded; store
    pages planned for reading or writing (reads and write-through writes share the worker's
    store thread) and not yet reported, in seconds at the tier's figures (writes at the store's
    measured seconds per written page, from STORE events);
  * this engine's step time: the scheduler side times each step from ``build`` (vLLM builds
    the step's metadata as it schedules it) to the first of ``step_ended`` (the connector's
    update_connector_output or request_finished, which vLLM calls as it processes the step's
    output) or the next ``build``, and fits hicache.domain.load_choice.PrefillModel to (tokens,
    attention work, seconds). With vLLM's asynchronous scheduling the next step is scheduled
    while this one runs, so no step is timed: without a prefill figure every hit is offered.
- ``choose(start, host_end, end, context)``: the end block to offer (hicache.domain.load_choice
  .choose_end); tokens declined are counted by the caller (``declined_tokens``). A tier whose
  tail was declined ``EXPLORE_EVERY`` times in a row is offered once more, so that its figure
  follows a store that became faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from hicache.domain import ConfigError
from hicache.domain.errors import shown
from hicache.domain.load_choice import (
    HitCosts,
    PageCost,
    PrefillModel,
    attention_work,
    choose_end,
)
from hicache.integrations.vllm.plan import Event, Op

MODES = ("measured", "always", "never")
# After this many declines in a row of a tier's pages, its pages are offered once (re-measure).
EXPLORE_EVERY = 32


def check_mode(value: object) -> str:
    if value not in MODES:
        raise ConfigError(
            f"kv_connector_extra_config 'load_policy' = {shown(value)}: expected one of "
            f"{', '.join(MODES)}"
        )
    return str(value)


class LoadPolicy:
    def __init__(
        self,
        mode: str = "measured",
        *,
        clock: Callable[[], float] = time.perf_counter,
        time_steps: bool = True,
    ) -> None:
        self.mode = check_mode(mode)
        self.clock = clock
        self.time_steps = time_steps
        self.host = PageCost()  # host -> device
        self.store = PageCost()  # store -> host
        self.store_write = PageCost()  # host -> store
        self.prefill = PrefillModel()
        self.host_queued = 0  # pages
        self.store_reads_queued = 0
        self.store_writes_queued = 0
        self._open: tuple[float, int, float] | None = None  # (start, tokens, attention)
        self._declined_in_row = [0, 0]  # host, store

    # ---- measurements ----------------------------------------------------------------------

    def step_built(self, steps: Iterable[tuple[int, int]]) -> None:
        """vLLM scheduled a step: (tokens held before, tokens computed) per request."""
        now = self.clock()
        self.step_ended(now)
        if not self.time_steps:
            return
        tokens, attention = 0, 0.0
        for context, n in steps:
            if n > 0:
                tokens += n
                attention += attention_work(n, context)
        self._open = (now, tokens, attention) if tokens > 0 else None

    def step_ended(self, now: float | None = None) -> None:
        """vLLM processes the output of the step built last (or schedules the next one)."""
        if self._open is None:
            return
        start, tokens, attention = self._open
        self._open = None
        end = self.clock() if now is None else now
        self.prefill.observe(tokens, attention, end - start)

    def observe(self, events: Sequence[Event]) -> None:
        """The workers' raw reports (each rank's): seconds per page of each tier."""
        sums: dict[Op, list[float]] = {}
        for e in events:
            if e.seconds > 0 and e.op in (Op.LOAD, Op.READ, Op.STORE):
                s = sums.setdefault(e.op, [0, 0.0])
                s[0] += 1
                s[1] += e.seconds
        for op, cost in ((Op.LOAD, self.host), (Op.READ, self.store), (Op.STORE, self.store_write)):
            if op in sums:
                cost.observe(int(sums[op][0]), sums[op][1])

    def planned(self, *, host: int = 0, reads: int = 0, writes: int = 0) -> None:
        """Pages queued on the tiers (positive: planned; negative: reported done)."""
        self.host_queued = max(0, self.host_queued + host)
        self.store_reads_queued = max(0, self.store_reads_queued + reads)
        self.store_writes_queued = max(0, self.store_writes_queued + writes)

    # ---- the choice ------------------------------------------------------------------------

    def costs(self) -> HitCosts:
        store_q = self.store.seconds(self.store_reads_queued) + self.store_write.seconds(
            self.store_writes_queued
        )
        a, _, _ = self.prefill.coefficients() if self.prefill.fitted else (0.0, 0.0, 0.0)
        return HitCosts(
            host_page_s=self.host.per_page_s,
            store_page_s=self.store.per_page_s,
            host_queued_s=self.host.seconds(self.host_queued),
            store_queued_s=store_q,
            store_latency_s=a,  # an asynchronous load is picked up one engine step later
        )

    def choose(self, *, start: int, host_end: int, end: int, block_size: int) -> int:
        """The end block (in ``[start, end]``) of the hit to offer vLLM."""
        if self.mode == "always" or end <= start:
            return end
        if self.mode == "never":
            return start
        chosen = choose_end(
            start=start,
            host_end=host_end,
            end=end,
            block_size=block_size,
            costs=self.costs(),
            saved=self.prefill,
        )
        # explore: a tier declined EXPLORE_EVERY times in a row is offered once
        host_end = min(max(host_end, start), end)
        for tier, (lo, hi) in enumerate(((start, host_end), (host_end, end))):
            if hi <= lo:
                continue
            if chosen >= hi:
                self._declined_in_row[tier] = 0
            else:
                self._declined_in_row[tier] += 1
                if self._declined_in_row[tier] > EXPLORE_EVERY:
                    self._declined_in_row[tier] = 0
                    return end if tier == 1 else max(chosen, hi)
        return chosen
