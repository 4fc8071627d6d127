"""Reads across tensor parallel sizes: which saved objects hold which KV heads (pure: no torch,
no vLLM).

A page saved by a server at tensor parallel size N is N store objects, ``kv-r<r>of<N>``: rank r's
blocks of every attention layer, holding the KV heads that rank computed. A server at size M
reads it by having each of its ranks take the heads it needs from the objects that hold them.

- TpHeads(total, replicated): a model's split (the functions below as methods).
- heads_of(rank, tp, total): the model's KV heads [lo, hi) rank ``rank`` of ``tp`` holds, by
  vLLM's rule (vllm/model_executor/layers/linear.py QKVParallelLinear, vllm/config/model.py
  get_num_kv_heads): ``total / tp`` heads each where tp divides the heads; where tp is larger
  the heads are replicated, rank r holding head ``r // (tp / total)``. ConfigError where
  neither divides the other.
- Piece / read_plan(total, writers, readers, rank, replicated): where reader rank ``rank`` of
  ``readers`` finds its heads among ``writers`` ranks' objects: (source rank, heads within the
  source object, heads within the reader's block), in head order. ``replicated`` (MLA's latent
  KV: every rank holds all of it) reads rank 0's object whole.
- is_direct(plan, ...): the plan is one whole object into the whole block (read in place).
- needed_writers(total, writers, replicated): the writer ranks a reader server needs between
  all its ranks (one replica of each head): what the scheduler checks exists.
- candidate_writers(total, readers): the writer sizes the scheduler tries, its own first.
- head_runs(piece, outer, inner, src_heads, dst_heads): a piece as byte runs (source offset,
  destination offset, length) inside one layer's block, for a block whose bytes are
  ``(outer, heads, inner)`` (vLLM's CPU cache: outer 1, inner block_size x (K + V) bytes of a
  head; a token-major GPU layout: outer block_size, inner one token's K + V bytes of a head).
- tagged(writers, rank, page) / untag(key): the page key a worker reads ``kv-r<rank>of<writers>``
  by (the store tier names objects from page keys); ``writer_tag(writers, page)`` the key
  the scheduler checks every needed object of a writer size by.
"""

from __future__ import annotations

import attrs

from hicache.domain import ConfigError

# Tags before a 32-byte page key (never a state key's prefix, b"state:").
TAG = b"tp:"  # + writers + source rank: one object
WRITERS_TAG = b"tpw:"  # + writers: every object a reader server needs
MAX_TP = 255  # one byte in the tag
CANDIDATE_SIZES = (1, 2, 4, 8, 16)  # tensor parallel sizes probed besides the reader's own


@attrs.frozen
class TpHeads:
    """What a model's pages are split by across ranks: ``total`` KV heads (vLLM's
    num_key_value_heads), or, ``replicated``, one latent every rank holds whole (MLA)."""

    total: int
    replicated: bool = False

    def per_rank(self, tp: int) -> int:
        return heads_per_rank(self.total, tp, replicated=self.replicated)

    def plan(self, writers: int, readers: int, rank: int) -> tuple[Piece, ...]:
        return read_plan(self.total, writers, readers, rank, replicated=self.replicated)

    def direct(self, plan: tuple[Piece, ...], writers: int, readers: int) -> bool:
        return is_direct(plan, self.total, writers, readers, replicated=self.replicated)

    def needed(self, writers: int) -> tuple[int, ...]:
        return needed_writers(self.total, writers, replicated=self.replicated)

    def candidates(self, readers: int) -> tuple[int, ...]:
        return candidate_writers(self.total, readers, replicated=self.replicated)


def _check(total: int, tp: int) -> None:
    if total < 1 or tp < 1 or tp > MAX_TP:
        raise ConfigError(
            f"KV heads {total}, tensor parallel size {tp}: expected at least 1 head and a "
            f"size from 1 to {MAX_TP}"
        )
    if total % tp and tp % total:
        raise ConfigError(
            f"tensor parallel size {tp} with {total} KV heads: expected a size that divides "
            "the KV heads or a multiple of them (vLLM's rule)"
        )


def compatible(total: int, tp: int) -> bool:
    """Whether a server of size ``tp`` can hold a model of ``total`` KV heads."""
    return 1 <= tp <= MAX_TP and total >= 1 and (total % tp == 0 or tp % total == 0)


def heads_of(rank: int, tp: int, total: int) -> tuple[int, int]:
    """The KV heads [lo, hi) that rank ``rank`` of ``tp`` holds (see the module docstring)."""
    _check(total, tp)
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} of tensor parallel size {tp}: expected 0 <= rank < {tp}")
    if tp <= total:
        per = total // tp
        return rank * per, (rank + 1) * per
    head = rank // (tp // total)
    return head, head + 1


@attrs.frozen
class Piece:
    """Heads [src_lo, src_hi) of source rank ``src``'s object go to heads [dst_lo, dst_hi) of
    the reader's block (both counted within the object / block)."""

    src: int
    src_lo: int
    src_hi: int
    dst_lo: int
    dst_hi: int


def read_plan(
    total: int, writers: int, readers: int, rank: int, *, replicated: bool = False
) -> tuple[Piece, ...]:
    """Where reader ``rank`` of ``readers`` finds its heads among ``writers`` objects."""
    if replicated:
        _check(1, writers)
        _check(1, readers)
        if not 0 <= rank < readers:
            raise ConfigError(f"rank {rank} of tensor parallel size {readers}: out of range")
        return (Piece(0, 0, 1, 0, 1),)
    lo, hi = heads_of(rank, readers, total)
    _check(total, writers)
    pieces: list[Piece] = []
    h = lo
    while h < hi:
        # the first writer rank holding head h (a replica where writers > total)
        src = h * writers // total if writers <= total else h * (writers // total)
        s_lo, s_hi = heads_of(src, writers, total)
        end = min(hi, s_hi)
        pieces.append(Piece(src, h - s_lo, end - s_lo, h - lo, end - lo))
        h = end
    return tuple(pieces)


def heads_per_rank(total: int, tp: int, *, replicated: bool = False) -> int:
    if replicated:
        return 1
    lo, hi = heads_of(0, tp, total)
    return hi - lo


def is_direct(
    plan: tuple[Piece, ...], total: int, writers: int, readers: int, *, replicated: bool = False
) -> bool:
    """One piece that is the whole source object and the whole reader block."""
    if len(plan) != 1:
        return False
    p = plan[0]
    src = heads_per_rank(total, writers, replicated=replicated)
    dst = heads_per_rank(total, readers, replicated=replicated)
    return p.src_lo == 0 and p.src_hi == src and p.dst_lo == 0 and p.dst_hi == dst


def needed_writers(total: int, writers: int, *, replicated: bool = False) -> tuple[int, ...]:
    """The writer ranks whose objects a reader server needs (one replica of each head)."""
    if replicated:
        _check(1, writers)
        return (0,)
    _check(total, writers)
    if writers <= total:
        return tuple(range(writers))
    return tuple(h * (writers // total) for h in range(total))


def candidate_writers(total: int, readers: int, *, replicated: bool = False) -> tuple[int, ...]:
    """The writer sizes a reader of size ``readers`` tries: its own, then the usual sizes and
    the divisors of the heads that fit the model, smallest first."""
    heads = 1 if replicated else total
    others = {n for n in CANDIDATE_SIZES if compatible(heads, n)}
    others |= {n for n in range(1, heads + 1) if heads % n == 0 and n <= MAX_TP}
    others.discard(readers)
    return (readers, *sorted(others))


def head_runs(
    piece: Piece, outer: int, inner: int, src_heads: int, dst_heads: int
) -> list[tuple[int, int, int]]:
    """``piece`` as (source offset, destination offset, length) byte runs in one layer's block
    of ``(outer, heads, inner)`` bytes (``src_heads`` in the source's, ``dst_heads`` in the
    reader's); heads next to each other are one run."""
    if outer < 1 or inner < 1:
        raise ConfigError(f"block geometry outer {outer}, inner {inner}: expected >= 1 each")
    n = piece.src_hi - piece.src_lo
    if n != piece.dst_hi - piece.dst_lo or piece.src_hi > src_heads or piece.dst_hi > dst_heads:
        raise ConfigError(
            f"{piece}: head ranges of different lengths or past {src_heads} source / "
            f"{dst_heads} reader heads"
        )
    return [
        (
            (o * src_heads + piece.src_lo) * inner,
            (o * dst_heads + piece.dst_lo) * inner,
            n * inner,
        )
        for o in range(outer)
    ]


def tagged(writers: int, rank: int, page: bytes) -> bytes:
    """The page key that names rank ``rank`` of ``writers``' object of ``page``."""
    if not (1 <= writers <= MAX_TP and 0 <= rank < writers):
        raise ConfigError(f"writer rank {rank} of {writers}: expected 0 <= rank < writers <= 255")
    return TAG + bytes((writers, rank)) + page


def writer_tag(writers: int, page: bytes) -> bytes:
    """The page key that names every object of ``page`` a reader needs from ``writers``."""
    if not 1 <= writers <= MAX_TP:
        raise ConfigError(f"writer size {writers}: expected 1 to {MAX_TP}")
    return WRITERS_TAG + bytes((writers,)) + page


def untag(key: bytes) -> tuple[str, int, int, bytes]:
    """``("one", writers, rank, page)``, ``("all", writers, 0, page)`` or
    ``("own", 0, 0, key)`` for an untagged key."""
    if key.startswith(TAG):
        n = len(TAG)
        return "one", key[n], key[n + 1], key[n + 2 :]
    if key.startswith(WRITERS_TAG):
        n = len(WRITERS_TAG)
        return "all", key[n], 0, key[n + 1 :]
    return "own", 0, 0, key


def kv_pool(rank: int, ranks: int) -> str:
    """The store pool of rank ``rank`` of ``ranks``' KV objects."""
    return f"kv-r{rank}of{ranks}"


__all__ = [
    "CANDIDATE_SIZES",
    "Piece",
    "TpHeads",
    "candidate_writers",
    "compatible",
    "head_runs",
    "heads_of",
    "heads_per_rank",
    "is_direct",
    "kv_pool",
    "needed_writers",
    "read_plan",
    "tagged",
    "untag",
    "writer_tag",
]
