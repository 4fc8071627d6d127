"""A worker's reads of pages that a server of another tensor parallel size stored (no vLLM import).

- head_geometry(name, cache, num_blocks, heads): one attention layer's block as ``(outer, heads,
  inner)`` bytes, from vLLM's registered cache: vLLM 0.32 hands each layer over as the logical
  ``[blocks, heads, tokens, content]`` view (vllm/v1/kv_cache_interface.py
  create_kv_cache_views), its strides giving the physical order. vLLM's CPU cache is
  ``[blocks, kv heads, block_size, K + V]`` contiguous: outer 1, a head one run of block_size
  x (K + V) bytes; a token-major layout (heads inside tokens) has outer block_size.
  ConfigError where the heads are not one dimension of a dense block.
- TpReader(heads, ranks, rank, geometry, store=...).read_each(store, tier, keys, slots, writers)
  (close() at shutdown drops its staging buffer): reads a
  batch of pages into host slots in one bounded store call. A page of this server's own size,
  or whose plan is one whole object (tp_plan.is_direct: the same heads), is read in place;
  another is read object by object (the writer ranks holding this rank's heads,
  ``kv-r<src>of<writers>``): an object this rank needs whole (fewer ranks reading what more
  wrote) goes straight into the slot as a list of byte runs (one segment per layer on vLLM's
  CPU cache: no copy); an object of which it needs part goes into a staging buffer, and each
  layer's head slices are copied into the slot once every object of the page was read whole
  (torch narrow/copy on the host). The
  host-to-device path after it is the usual one. A page is OK only when all its objects were;
  the staging buffer lives until the store call has really ended (``settled``), then is kept for
  the next read (one buffer, up to SPARE_MAX_BYTES: fresh memory would page-fault on every read).
  With ``store`` given, each staging buffer is registered with it (Store.register: Mooncake
  moves bytes only to and from registered memory) and unregistered before it is freed; a
  refused registration answers the pages that needed it INVALID unread (recomputed). Without the
  geometry (``layers`` None: a cache head_geometry refused, logged at start) a page that needs
  slices is answered INVALID unread: a miss, recomputed.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import attrs
import torch

from hicache.domain import ConfigError, HostMemory, StoreError
from hicache.domain.storage import Store, StoreStatus
from hicache.engine.bounded import Answer, BoundedTier
from hicache.engine.logs import get_logger
from hicache.integrations.vllm.block_rows import block_order
from hicache.integrations.vllm.tp_plan import Piece, TpHeads, head_runs, tagged
from hicache.integrations.vllm.worker_host import HostTier, unregister
from hicache.integrations.vllm.worker_parts import HostRows, host_memory_for

log = get_logger("hicache.vllm")

SPARE_MAX_BYTES = 256 << 20  # the largest staging buffer kept for the next read
MAX_SEGMENTS = 1024  # runs of one object read straight into a host slot


@attrs.frozen
class LayerHeads:
    """One attention layer's block as ``(outer, heads, inner)`` bytes."""

    name: str
    outer: int
    inner: int


def head_geometry(name: str, cache: torch.Tensor, num_blocks: int, heads: int) -> LayerHeads:
    """Layer ``name``'s block geometry (see the module docstring)."""
    if cache.dim() != 4 or cache.shape[0] != num_blocks or cache.shape[1] != heads:
        raise ConfigError(
            f"HiCacheConnector: vLLM cache of layer {name!r} has shape {tuple(cache.shape)}; "
            f"expected [{num_blocks} blocks, {heads} KV heads, tokens, content] to read pages "
            "stored at another tensor parallel size"
        )
    order = block_order(cache)  # the dimensions inside a block, outermost first
    if order is None:
        raise ConfigError(
            f"HiCacheConnector: vLLM cache of layer {name!r} (shape {tuple(cache.shape)}, "
            f"strides {cache.stride()}) is not one dense run per block; pages stored at "
            "another tensor parallel size cannot be sliced by head"
        )
    at = order.index(1)
    outer = 1
    for d in order[:at]:
        outer *= int(cache.shape[d])
    inner = cache.element_size()
    for d in order[at + 1 :]:
        inner *= int(cache.shape[d])
    return LayerHeads(name, outer, inner)


class TpReader:
    """Reads pages stored at any tensor parallel size into rank ``rank``'s host slots."""

    def __init__(
        self,
        heads: TpHeads,
        ranks: int,
        rank: int,
        layers: Sequence[LayerHeads] | None,
        *,
        store: Store | None = None,
        host_memory: HostMemory | None = None,
    ) -> None:
        self.heads = heads
        self.ranks = ranks
        self.rank = rank
        self.layers = list(layers) if layers is not None else None  # None: no slicing
        self.store = store  # registers the staging buffers (a zero-copy store: Mooncake)
        self._plans: dict[int, tuple[tuple[Piece, ...], bool]] = {}
        self._lock = threading.Lock()
        # staging buffers come from hicache's host-memory adapters; they never meet the device,
        # so unpinned anonymous memory unless told otherwise
        self.host_memory = host_memory or host_memory_for(torch.device("cpu"))
        self._spare: HostRows | None = None  # a staging buffer no store call holds
        self._closed = False

    def close(self) -> None:
        """Drop the spare staging buffer (unregistered); one a store call still holds is
        dropped when that call ends. Reads after close allocate again."""
        with self._lock:
            spare, self._spare = self._spare, None
            self._closed = True
        if spare is not None:
            self._drop(spare)

    def _staging(self, nbytes: int) -> HostRows | None:
        """``nbytes`` of host memory for source objects, registered with the store: the spare
        buffer when it is free and large enough (no page faults or registration on every
        read), else a new one; None when the store refused to register it (logged)."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare.tensor.numel() >= nbytes:
            return spare
        if spare is not None:
            self._drop(spare)
        buffer = HostRows(1, nbytes, host_memory=self.host_memory, device=torch.device("cpu"))
        if self.store is not None:
            try:
                self.store.register([_bytes(buffer.tensor[0])])
            except StoreError as exc:
                log.warning("vllm.tp_staging_unregistered", nbytes=nbytes, reason=str(exc))
                buffer.close()
                return None
        return buffer

    def _drop(self, buffer: HostRows) -> None:
        """Unregister a staging buffer no store call holds any more, then free it (in that
        order: a transport must never keep memory the allocator may hand out again)."""
        if self.store is not None:
            unregister(self.store, buffer.tensor.data_ptr())
        buffer.close()

    def _release(self, staging: HostRows) -> None:
        """Keep ``staging`` for the next read (the largest one up to SPARE_MAX_BYTES), else
        drop it; called once the store call that wrote it has ended."""
        drop: HostRows | None = staging
        size = staging.tensor.numel()
        if size <= SPARE_MAX_BYTES:
            with self._lock:
                if self._closed:
                    pass
                elif self._spare is None or self._spare.tensor.numel() < size:
                    drop, self._spare = self._spare, staging  # the smaller one goes
        if drop is not None:
            self._drop(drop)

    def own(self, writers: int) -> bool:
        return writers in (0, self.ranks)

    def plan(self, writers: int) -> tuple[tuple[Piece, ...], bool]:
        """This rank's pieces of a page stored by ``writers`` ranks, and whether direct."""
        got = self._plans.get(writers)
        if got is None:
            pieces = self.heads.plan(writers, self.ranks, self.rank)
            got = self._plans[writers] = (pieces, self.heads.direct(pieces, writers, self.ranks))
        return got

    def source_bytes(self, writers: int) -> int:
        """Bytes of one object stored by a rank of ``writers``."""
        per = self.heads.per_rank(writers)
        assert self.layers is not None
        return sum(layer.outer * per * layer.inner for layer in self.layers)

    def read_each(
        self,
        store: BoundedTier,
        tier: HostTier,
        keys: Sequence[bytes],
        slots: Sequence[int],
        writers: Sequence[int],
    ) -> Answer[list[StoreStatus]]:
        """Each page's status once read (and assembled); see the module docstring."""
        asked: list[bytes] = []
        buffers: list[list[memoryview]] = []
        owner: list[int] = []  # the page of each object read
        staged: dict[int, list[Piece]] = {}  # page -> the pieces read through staging
        refused: set[int] = set()  # pages that need slices this cache cannot take
        for i, (key, slot, w) in enumerate(zip(keys, slots, writers, strict=True)):
            if self.own(w):
                asked.append(key)
                buffers.append(tier.page(slot, key))
                owner.append(i)
                continue
            pieces, direct = self.plan(w)
            if direct:
                asked.append(tagged(w, pieces[0].src, key))
                buffers.append(tier.page(slot, key))
                owner.append(i)
                continue
            if self.layers is None:
                refused.add(i)
                continue
            for piece in pieces:
                segments = self._scatter(tier, slot, w, piece)
                if segments is not None:  # a whole object: straight into the slot's runs
                    asked.append(tagged(w, piece.src, key))
                    buffers.append(segments)
                    owner.append(i)
                else:
                    staged.setdefault(i, []).append(piece)
        need = sum(self.source_bytes(writers[i]) * len(p) for i, p in staged.items())
        staging = self._staging(need) if need else None
        if staging is None:  # nothing to stage, or the store refused the buffer: recomputed
            refused.update(staged)
            staged = {}
        sources: dict[int, list[tuple[Piece, torch.Tensor]]] = {}  # page -> (piece, its bytes)
        at = 0
        for i, page_pieces in staged.items():
            assert staging is not None
            n = self.source_bytes(writers[i])
            for piece in page_pieces:
                src = staging.tensor[0].narrow(0, at, n)
                at += n
                sources.setdefault(i, []).append((piece, src))
                asked.append(tagged(writers[i], piece.src, keys[i]))
                buffers.append([_bytes(src)])
                owner.append(i)
        answer = store.read_each(asked, buffers)

        status = [StoreStatus.INVALID if i in refused else StoreStatus.OK for i in range(len(keys))]
        for i, s in zip(owner, answer.value, strict=True):
            if status[i].ok and not s.ok:
                status[i] = s
        if answer.answered:  # else every page failed (the tier's default answer)
            for i, page_sources in sources.items():
                if status[i].ok:
                    self._assemble(tier, slots[i], writers[i], page_sources)
        if staging is not None:  # the store may write the staging until settled
            kept = staging
            answer.settled.add_done_callback(lambda _f: self._release(kept))
        return Answer(status, answer.outcome, answer.settled)

    def _scatter(
        self, tier: HostTier, slot: int, writers: int, piece: Piece
    ) -> list[memoryview] | None:
        """The host slot's byte runs a whole source object fills, in the object's order (one
        per layer on vLLM's CPU cache); None for part of an object or too many runs."""
        assert self.layers is not None
        src_heads = self.heads.per_rank(writers)
        if piece.src_lo != 0 or piece.src_hi != src_heads:
            return None
        if sum(layer.outer for layer in self.layers) > MAX_SEGMENTS:
            return None
        dst_heads = self.heads.per_rank(self.ranks)
        segments: list[memoryview] = []
        for layer in self.layers:
            row = tier.layer(layer.name)[slot]
            for _, d, n in head_runs(piece, layer.outer, layer.inner, src_heads, dst_heads):
                segments.append(memoryview(row.narrow(0, d, n).numpy()).cast("B"))  # type: ignore[arg-type]
        return segments

    def _assemble(
        self,
        tier: HostTier,
        slot: int,
        writers: int,
        sources: Sequence[tuple[Piece, torch.Tensor]],
    ) -> None:
        src_heads = self.heads.per_rank(writers)
        dst_heads = self.heads.per_rank(self.ranks)
        assert self.layers is not None
        for piece, src in sources:
            off = 0
            for layer in self.layers:
                n = layer.outer * src_heads * layer.inner
                s = src.narrow(0, off, n).view(layer.outer, src_heads, layer.inner)
                d = tier.layer(layer.name)[slot].view(layer.outer, dst_heads, layer.inner)
                width = piece.src_hi - piece.src_lo
                d.narrow(1, piece.dst_lo, width).copy_(s.narrow(1, piece.src_lo, width))
                off += n


def _bytes(t: torch.Tensor) -> memoryview:
    """A contiguous uint8 tensor's bytes (no copy)."""
    return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]


__all__ = ["LayerHeads", "TpReader", "head_geometry"]
