"""Agreement over tensor-parallel ranks: every rank of a TP group must restore the same prefix.

- RankAgreement: the port a serving framework backs with its process group; ``await
  agree_min(values)`` returns the element-wise minimum of ``values`` over all ranks of the group
  (one all-reduce with MIN for the whole tuple). Every rank must call it the same number of
  times, in the same order, with tuples of the same length.
- SingleProcess: the default for one rank: the values as given.
- One process per rank: hicache.adapters.tp_agreement.TorchRankAgreement (torch.distributed,
  a store exchange with a deadline: a dead or late rank makes every rank miss, never hang).

Why async and in the engine layer: an agreement across processes blocks; an implementation runs
it off the event loop (``anyio.to_thread.run_sync``) and the face awaits it, so the port is an
async Protocol here rather than a synchronous domain port. SGLang does the same
reduction where ranks may disagree on a hit: the storage hit count of a prefetch
(python/sglang/srt/managers/cache_controller.py, ``prefetch_thread_func``: ``all_reduce(...,
op=ReduceOp.MIN, group=self.prefetch_tp_group)``) and the number of finished write-throughs
(python/sglang/srt/mem_cache/hiradix_cache.py, ``writing_check``: MIN over ``tp_group``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import anyio.lowlevel


@runtime_checkable
class RankAgreement(Protocol):
    """The element-wise minimum of a tuple of ints over the ranks of a TP group."""

    async def agree_min(self, values: Sequence[int]) -> tuple[int, ...]: ...


class SingleProcess:
    """One rank: nothing to agree with."""

    async def agree_min(self, values: Sequence[int]) -> tuple[int, ...]:
        await anyio.lowlevel.checkpoint()
        return tuple(values)

    def __repr__(self) -> str:
        return "<SingleProcess>"


__all__ = ["RankAgreement", "SingleProcess"]
