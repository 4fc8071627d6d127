"""hicache.adapters.copy.rows: whole-row copies between a framework's rows and host rows."""

from __future__ import annotations

import pytest
import torch

from hicache.adapters.copy.rows import RowCopier, _runs, row_copier
from hicache.domain import ConfigError, TransferError


@pytest.mark.parametrize("backend", ["memcpy", "torch"])
def test_rows_land_where_asked_also_from_strided_rows(backend: str) -> None:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (8, 96), generator=g, dtype=torch.uint8)
    src = raw[:, :64]  # strided rows: each row skips 32 bytes of padding
    dst = torch.zeros(5, 64, dtype=torch.uint8)
    row_copier(backend, torch.device("cpu"), pinned=False).copy(dst, [4, 0, 1], src, [7, 2, 3])
    assert torch.equal(dst[4], src[7])
    assert torch.equal(dst[0], src[2])
    assert torch.equal(dst[1], src[3])
    assert not dst[2].any()  # rows not asked for are untouched


def test_runs_coalesce_rows_consecutive_on_both_sides() -> None:
    assert _runs([5, 6, 7, 9, 10], [1, 2, 3, 4, 5]) == [(5, 1, 3), (9, 4, 2)]
    assert _runs([], []) == []


def test_backends_that_do_not_fit_the_device_are_refused_with_the_alternative() -> None:
    meta = torch.device("meta")
    with pytest.raises(ConfigError, match="'memcpy' copies CPU memory only"):
        row_copier("memcpy", meta, pinned=True)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        row_copier("cuda_batch", torch.device("cpu"), pinned=False)
    with pytest.raises(ConfigError, match="unknown row copy backend"):
        row_copier("fast", torch.device("cpu"), pinned=False)
    assert row_copier("auto", torch.device("cpu"), pinned=False).backend == "memcpy"


def test_rows_of_different_widths_or_counts_are_a_transfer_error() -> None:
    c = RowCopier("torch")
    with pytest.raises(TransferError, match="equal width"):
        c.copy(torch.zeros(2, 8, dtype=torch.uint8), [0], torch.zeros(2, 4, dtype=torch.uint8), [0])
    with pytest.raises(TransferError, match="2 destination rows for 1"):
        c.copy(
            torch.zeros(2, 8, dtype=torch.uint8), [0, 1], torch.zeros(2, 8, dtype=torch.uint8), [0]
        )
