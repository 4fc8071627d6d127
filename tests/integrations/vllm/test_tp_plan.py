"""The cross-TP read plan (hicache.integrations.vllm.tp_plan), exhaustively over small models."""

from __future__ import annotations

import pytest

from hicache.domain import ConfigError
from hicache.integrations.vllm.tp_plan import (
    Piece,
    candidate_writers,
    compatible,
    head_runs,
    heads_of,
    heads_per_rank,
    is_direct,
    kv_pool,
    needed_writers,
    read_plan,
    tagged,
    untag,
    writer_tag,
)

HEADS = (1, 2, 4, 6, 8)
SIZES = (1, 2, 3, 4, 6, 8, 16)
CASES = [
    (h, n, m) for h in HEADS for n in SIZES for m in SIZES if compatible(h, n) and compatible(h, m)
]


def _object(total: int, tp: int, rank: int, outer: int, inner: int) -> list[tuple[int, int, int]]:
    """A rank's block as cells (global head, outer index, inner index) in (outer, heads, inner)
    order: what each byte of it means."""
    lo, hi = heads_of(rank, tp, total)
    return [(h, o, i) for o in range(outer) for h in range(lo, hi) for i in range(inner)]


def test_heads_follow_vllms_split_and_replication() -> None:
    assert [heads_of(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [heads_of(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert heads_of(0, 1, 1) == (0, 1)
    assert [heads_of(r, 8, 1)[0] for r in range(8)] == [0] * 8


@pytest.mark.parametrize(("total", "tp"), [(3, 2), (2, 3), (8, 3), (0, 1), (4, 256)])
def test_sizes_that_do_not_divide_the_heads_are_refused(total: int, tp: int) -> None:
    with pytest.raises(ConfigError, match=r"tensor parallel size|KV heads"):
        heads_of(0, tp, total)


def test_a_rank_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="rank 2 of tensor parallel size 2"):
        heads_of(2, 2, 4)


@pytest.mark.parametrize(("total", "writers", "readers"), CASES)
def test_every_reader_rank_gets_exactly_its_heads_from_writers_that_hold_them(
    total: int, writers: int, readers: int
) -> None:
    need = set(needed_writers(total, writers))
    for q in range(readers):
        lo, hi = heads_of(q, readers, total)
        plan = read_plan(total, writers, readers, q)
        got: list[int] = []
        for p in plan:
            assert p.src in need
            s_lo, s_hi = heads_of(p.src, writers, total)
            assert 0 <= p.src_lo < p.src_hi <= s_hi - s_lo
            assert p.dst_hi - p.dst_lo == p.src_hi - p.src_lo
            assert p.dst_lo == len(got)  # in order, no gap
            got.extend(s_lo + h for h in range(p.src_lo, p.src_hi))
        assert got == list(range(lo, hi))
        direct = is_direct(plan, total, writers, readers)
        assert direct == (len(plan) == 1 and heads_of(plan[0].src, writers, total) == (lo, hi))
    if writers == readers:  # the same size reads one whole object per rank
        assert all(
            is_direct(read_plan(total, writers, readers, q), total, writers, readers)
            for q in range(readers)
        )


@pytest.mark.parametrize(("total", "writers", "readers"), CASES)
@pytest.mark.parametrize(("outer", "inner"), [(1, 3), (4, 2)])
def test_byte_runs_assemble_the_reader_block_cell_for_cell(
    total: int, writers: int, readers: int, outer: int, inner: int
) -> None:
    src_heads = heads_per_rank(total, writers)
    dst_heads = heads_per_rank(total, readers)
    objects = {r: _object(total, writers, r, outer, inner) for r in range(writers)}
    for q in range(readers):
        block: list[tuple[int, int, int] | None] = [None] * (outer * dst_heads * inner)
        for p in read_plan(total, writers, readers, q):
            for s, d, n in head_runs(p, outer, inner, src_heads, dst_heads):
                assert block[d : d + n] == [None] * n  # no cell written twice
                block[d : d + n] = objects[p.src][s : s + n]
        assert block == _object(total, readers, q, outer, inner)


@pytest.mark.parametrize("writers", SIZES)
@pytest.mark.parametrize("readers", SIZES)
def test_replicated_latent_kv_reads_rank_zeros_object_whole(writers: int, readers: int) -> None:
    for q in range(readers):
        plan = read_plan(1, writers, readers, q, replicated=True)
        assert plan == (Piece(0, 0, 1, 0, 1),)
        assert is_direct(plan, 1, writers, readers, replicated=True)
    assert needed_writers(8, writers, replicated=True) == (0,)


def test_needed_writers_take_one_replica_of_each_head() -> None:
    assert needed_writers(8, 2) == (0, 1)
    assert needed_writers(2, 8) == (0, 4)
    assert needed_writers(1, 4) == (0,)


def test_candidates_try_the_readers_own_size_first_then_what_fits_the_model() -> None:
    assert candidate_writers(8, 2) == (2, 1, 4, 8, 16)
    assert candidate_writers(2, 1) == (1, 2, 4, 8, 16)
    assert candidate_writers(6, 3) == (3, 1, 2, 6)
    assert all(compatible(6, n) for n in candidate_writers(6, 3))


def test_head_runs_refuse_pieces_that_do_not_fit() -> None:
    with pytest.raises(ConfigError, match="head ranges"):
        head_runs(Piece(0, 0, 2, 0, 1), 1, 4, 2, 1)
    with pytest.raises(ConfigError, match="geometry"):
        head_runs(Piece(0, 0, 1, 0, 1), 0, 4, 1, 1)


def test_tags_round_trip_and_never_look_like_a_plain_or_state_key() -> None:
    page = bytes(range(32))
    assert untag(tagged(4, 3, page)) == ("one", 4, 3, page)
    assert untag(writer_tag(2, page)) == ("all", 2, 0, page)
    assert untag(page) == ("own", 0, 0, page)
    assert untag(b"state:" + page) == ("own", 0, 0, b"state:" + page)
    assert kv_pool(1, 2) == "kv-r1of2"
    with pytest.raises(ConfigError, match="writer rank 2 of 2"):
        tagged(2, 2, page)
