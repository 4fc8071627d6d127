"""The worker's host tier: where a rank keeps its saved blocks and states (no vLLM import).

- HostTier(layers, state_layers, host_bytes=..., state_host_bytes=..., host_memory=..., device=...):
  ``pages``, ``(slots, page_bytes)`` uint8 rows on one hicache host memory region (a page is one
  block of every attention layer, back to back: one contiguous store object), and for a hybrid
  model ``states``, ``(state_slots, state_bytes)`` rows on a second region (one state of every
  state layer). Both come from hicache's host-memory adapters (pinned on CUDA; a pinning failure
  is an error, never pageable memory); a model without state layers has no state region.
- layer(name) / state(name): the host columns of one attention or state layer (views made once).
- page(slot, key): a page's or a state's bytes as the store reads and writes them.
- DeviceError when ``host_gib`` leaves less than one page (or one state).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.domain import DeviceError, HostMemory
from hicache.integrations.vllm.plan import is_state
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
        host_memory: HostMemory,
        device: torch.device,
    ) -> None:
        offsets, self.page_bytes = _columns(layers)
        state_offsets, self.state_bytes = _columns(state_layers)
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
        self._pages = HostRows(slots, self.page_bytes, host_memory=host_memory, device=device)
        self._states: HostRows | None = None
        try:
            if state_layers:
                self._states = HostRows(
                    state_slots, self.state_bytes, host_memory=host_memory, device=device
                )
        except BaseException:
            self._pages.close()
            raise
        self.pages = self._pages.tensor
        self._layer = {n: self.pages.narrow(1, o, w) for n, (o, w) in offsets.items()}
        self._state = (
            {n: self._states.tensor.narrow(1, o, w) for n, (o, w) in state_offsets.items()}
            if self._states is not None
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
    def pinned(self) -> bool:
        """Whether the host pages are page-locked (on CUDA)."""
        return bool(self._pages.pinned)

    def layer(self, name: str) -> torch.Tensor:
        """Attention layer ``name``'s columns of every host page, ``(slots, block_bytes)``."""
        return self._layer[name]

    def state(self, name: str) -> torch.Tensor:
        """State layer ``name``'s columns of every host state, ``(state_slots, used_bytes)``."""
        return self._state[name]

    def nbytes(self, key: bytes) -> int:
        return self.state_bytes if is_state(key) else self.page_bytes

    def page(self, slot: int, key: bytes) -> list[memoryview]:
        """The bytes of page (or, for a state key, state) ``slot`` as one store segment."""
        rows = self.states if is_state(key) else self.pages
        return [memoryview(rows[slot].numpy()).cast("B")]  # type: ignore[arg-type]

    def close(self) -> None:
        self._pages.close()
        if self._states is not None:
            self._states.close()
