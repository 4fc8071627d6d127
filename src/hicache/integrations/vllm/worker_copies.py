"""The worker side's copies between vLLM's blocks and the host pages (the copy streams).

DeviceCopies: a layer's load (host -> vLLM's blocks) and save (vLLM's blocks -> host) of a
step's pages, a hybrid model's states and a sliding-window model's window pages (one block of
each state or sliding group per page), and the host-to-device copies the store thread makes
off vLLM's step (after the saves in flight and vLLM's zeroing of the blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hicache.domain.ports import Direction
from hicache.integrations.vllm.plan import SaveOp, StateLoad, StateSave, is_window
from hicache.integrations.vllm.worker_parts import CudaOrder
from hicache.integrations.vllm.worker_state import Step, TransfersState


class DeviceCopies(TransfersState):
    """WorkerTransfers's copies (module docstring)."""

    def _loader(
        self, step: Step, name: str, slots: Sequence[int], blocks: Sequence[int]
    ) -> Callable[[], None]:

        def load() -> None:
            try:
                self.copier.copy(self.rows[name], blocks, self.tier.layer(name), slots)
            except BaseException as exc:
                step.load_failed.append(exc)
                raise

        return load

    def _save_rows(self, name: str, saves: Sequence[SaveOp]) -> None:
        self.copier.copy(
            self.tier.layer(name),
            [op.slot for op in saves],
            self.rows[name],
            [op.block for op in saves],
        )

    def _save_pages(self, pages: torch.Tensor, saves: Sequence[SaveOp]) -> None:
        """Whole pages (``pages``: page_rows): one row per page, every layer at once."""
        self.copier.copy(
            self.tier.pages, [op.slot for op in saves], pages, [op.block for op in saves]
        )

    def _group_layers(self, window: bool) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """(host columns, group position, device rows) of every state or sliding layer."""
        if window:
            return [(self.tier.window(n), g, rows) for n, g, rows in self.window_layers]
        return [(self.tier.state(n), g, rows) for n, g, rows in self.state_layers]

    def _save_states(self, saves: Sequence[StateSave]) -> None:
        """States and window pages: one block of each group per save."""
        for window in (False, True):
            mine = [op for op in saves if is_window(op.key) == window]
            if not mine:
                continue
            slots = [op.slot for op in mine]
            for host, group, rows in self._group_layers(window):
                self.copier.copy(host, slots, rows, [op.blocks[group] for op in mine])

    def _to_device_now(self, work: Callable[[], None]) -> None:
        """Host-to-device copies off vLLM's step (store thread): on the load stream, after
        the saves in flight, waited for here."""
        if isinstance(self.order, CudaOrder):
            backup = self.streams.stream(Direction.BACKUP)  # type: ignore[attr-defined]
            self.streams.after_compute(Direction.LOAD, backup)
            if self._compute_point is not None:  # vLLM's zeroing of the blocks
                self.streams.after_compute(Direction.LOAD, self._compute_point)
        else:
            with self._lock:
                inflight = list(self._inflight)
            for st in inflight:
                for ev in (*st.saves.values(), st.state):
                    if ev is not None:
                        ev.wait_current()
        self.streams.submit(Direction.LOAD, work).synchronize()

    def _load_groups(self, loads: Sequence[StateLoad]) -> None:
        """States and window pages into their groups' blocks."""

        def work() -> None:
            for window in (False, True):
                mine = [op for op in loads if is_window(op.key) == window]
                if not mine:
                    continue
                slots = [op.slot for op in mine]
                for host, group, rows in self._group_layers(window):
                    self.copier.copy(rows, [op.blocks[group] for op in mine], host, slots)

        self._to_device_now(work)

    def _copy_pages(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        def work() -> None:
            if self.page_rows is not None:  # one row per page, every layer at once
                self.copier.copy(self.page_rows, blocks, self.tier.pages, slots)
                return
            for name in self.names:
                self.copier.copy(self.rows[name], blocks, self.tier.layer(name), slots)

        self._to_device_now(work)
