"""The worker's host tier: where a rank keeps its saved blocks and states (no vLLM import).

- HostTier(layers, state_layers, host_bytes=..., state_host_bytes=..., host_memory=..., device=...):
  ``pages``, ``(slots, page_bytes)`` uint8 rows on one hicache host memory region (a page is one
  block of every attention layer, back to back: one contiguous store object), and for a hybrid
  model ``states``, ``(state_slots, state_bytes)`` rows on a second region (one state of every
  state layer), and for a sliding-window model ``windows``, ``(window_slots, window_bytes)`` rows
  on a third (one block of every sliding-window layer). Both come from hicache's host-memory adapters (pinned on CUDA; a pinning failure
  is an error, never pageable memory); a model without state layers has no state region.
- layer(name) / state(name) / window(name): the host columns of one attention, state or
  sliding-window layer (views made once).
- page(slot, key): a page's, a state's or a window page's bytes as the store reads and writes
  them.
- regions(): the host memory of the rows, one byte range per region (what a zero-copy store
  such as Mooncake must register before it moves a page; the worker role registers them).
- address(view) / unregister(store, start): undo a store's registration of memory where the store has an
  ``unregister(address)`` (Mooncake; not part of the Store port: stores that ignore register
  have none).
- DeviceError when ``host_gib`` leaves less than one page (or one state).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hicache.domain import DeviceError, HostMemory
from hicache.integrations.vllm.plan import is_state, is_window
from hicache.integrations.vllm.worker_parts import HostRows


def _columns(widths: Sequence[tuple[str, int]]) -> tuple[dict[str, tuple[int, int]], int]:
    """Each layer's (offset, width) in a row of the layers back to back, and the row's width."""
    offsets: dict[str, tuple[int, int]] = {}
    off = 0
    for name, width in widths:
        offsets[name] = (off, width)
        off += width
    return offsets, off


class HostTier:
    """A rank's host pages and (hybrid models) host states. See the module docstring."""

    def __init__(
        self,
        layers: Sequence[tuple[str, int]],
        state_layers: Sequence[tuple[str, int]] = (),
        *,
        host_bytes: int,
        state_host_bytes: int = 0,
        window_layers: Sequence[tuple[str, int]] = (),
        window_host_bytes: int = 0,
        host_memory: HostMemory,
        device: torch.device,
    ) -> None:
        offsets, self.page_bytes = _columns(layers)
        state_offsets, self.state_bytes = _columns(state_layers)
        window_offsets, self.window_bytes = _columns(window_layers)
        slots = host_bytes // self.page_bytes if self.page_bytes else 0
        if slots < 1:
            raise DeviceError(
                f"host_gib gives {host_bytes} bytes, less than one page of {self.page_bytes} "
                "bytes (one block of every layer)"
            )
        state_slots = state_host_bytes // self.state_bytes if self.state_bytes else 0
        if state_layers and state_slots < 1:
            raise DeviceError(
                f"host_gib gives {state_host_bytes} bytes for states, less than one state of "
                f"{self.state_bytes} bytes (every state layer)"
            )
        window_slots = window_host_bytes // self.window_bytes if self.window_bytes else 0
        if window_layers and window_slots < 1:
            raise DeviceError(
                f"host_gib gives {window_host_bytes} bytes for window pages, less than one of "
                f"{self.window_bytes} bytes (a block of every sliding-window layer)"
            )
        self._pages = HostRows(slots, self.page_bytes, host_memory=host_memory, device=device)
        self._states: HostRows | None = None
        self._windows: HostRows | None = None
        try:
            if state_layers:
                self._states = HostRows(
                    state_slots, self.state_bytes, host_memory=host_memory, device=device
                )
            if window_layers:
                self._windows = HostRows(
                    window_slots, self.window_bytes, host_memory=host_memory, device=device
                )
        except BaseException:
            self.close()
            raise
        self.pages = self._pages.tensor
        self._layer = {n: self.pages.narrow(1, o, w) for n, (o, w) in offsets.items()}
        self._state = (
            {n: self._states.tensor.narrow(1, o, w) for n, (o, w) in state_offsets.items()}
            if self._states is not None
            else {}
        )
        self._window = (
            {n: self._windows.tensor.narrow(1, o, w) for n, (o, w) in window_offsets.items()}
            if self._windows is not None
            else {}
        )

    @property
    def slots(self) -> int:
        return int(self.pages.shape[0])

    @property
    def states(self) -> torch.Tensor:
        """The state rows; DeviceError for a model without state layers."""
        if self._states is None:
            raise DeviceError("this worker has no host states: the model has no state layers")
        return self._states.tensor

    @property
    def windows(self) -> torch.Tensor:
        """The window page rows; DeviceError for a model without sliding-window groups."""
        if self._windows is None:
            raise DeviceError("this worker has no host window pages: no sliding-window groups")
        return self._windows.tensor

    @property
    def pinned(self) -> bool:
        """Whether the host pages are page-locked (on CUDA)."""
        return bool(self._pages.pinned)

    def layer(self, name: str) -> torch.Tensor:
        """Attention layer ``name``'s columns of every host page, ``(slots, block_bytes)``."""
        return self._layer[name]

    def state(self, name: str) -> torch.Tensor:
        """State layer ``name``'s columns of every host state, ``(state_slots, used_bytes)``."""
        return self._state[name]

    def window(self, name: str) -> torch.Tensor:
        """Sliding layer ``name``'s columns of every host window page, ``(window_slots,
        block_bytes)``."""
        return self._window[name]

    def nbytes(self, key: bytes) -> int:
        if is_state(key):
            return self.state_bytes
        return self.window_bytes if is_window(key) else self.page_bytes

    def page(self, slot: int, key: bytes) -> list[memoryview]:
        """The bytes of page (or, for a state or window key, state or window page) ``slot`` as
        one store segment."""
        rows = self.states if is_state(key) else self.windows if is_window(key) else self.pages
        return [memoryview(rows[slot].numpy()).cast("B")]  # type: ignore[arg-type]

    def regions(self) -> list[memoryview]:
        """The host memory of every page, state and window row, one byte range per region:
        what a zero-copy store (Mooncake) registers before it can read or write a page."""
        rows = [self._pages] + [r for r in (self._states, self._windows) if r is not None]
        return [memoryview(r.tensor.numpy()).cast("B") for r in rows]  # type: ignore[arg-type]

    def close(self) -> None:
        self._pages.close()
        for rows in (self._states, self._windows):
            if rows is not None:
                rows.close()


def address(view: memoryview) -> int:
    """The address of ``view``'s first byte (no copy, nothing read)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def unregister(store: object, start: int) -> None:
    """Forget ``store``'s registration of the memory at ``start`` where the store has
    ``unregister(address)``; a no-op for stores without one."""
    undo = getattr(store, "unregister", None)
    if undo is not None and start:
        undo(start)
