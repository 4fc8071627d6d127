"""`hicache bench sglang --json`: the schema, byte-checked round trips, and corruption measured
(hicache detects a flipped byte on disk; HiCacheFile's answer is reported as measured)."""

from __future__ import annotations

import contextlib
import json

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from hicache.cli import main  # noqa: E402

pytestmark = pytest.mark.sglang

SMALL = ["--pages", "3", "--page-size", "4", "--layers", "2", "--heads", "1", "--head-dim", "8"]


def test_bench_sglang_prints_both_backends_figures_and_corruption(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "sglang", "--json", "--repeats", "1", *SMALL]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["pages"] == 3
    assert (
        doc["page_bytes"] == 2 * 2 * 4 * 1 * 8 * 2
    )  # K and V x layers x tokens x heads x dim x bf16
    for side in ("hicache", "hicache_file"):
        assert {"put_gbps", "get_gbps", "exists_per_s"} <= set(doc[side])
        assert all(doc[side][k] > 0 for k in ("put_gbps", "get_gbps", "exists_per_s"))
    assert doc["corruption_detected"]["hicache"] is True
    assert isinstance(doc["corruption_detected"]["hicache_file"], bool)


def test_bench_sglang_moves_the_pages_asked_and_its_ratios_are_this_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What a reader of the figures relies on: each measured round moved every page asked
    for, byte-checked, on both sides (hicache's own store counts the same pages, plus the
    warm-up round and the damaged page), and the ratios are the quotients of this run's own
    figures, not numbers from elsewhere."""
    pages, repeats = 5, 3
    args = ["--pages", str(pages), *SMALL[2:], "--repeats", str(repeats)]
    assert main(["bench", "sglang", "--json", *args]) == 0
    doc = json.loads(capsys.readouterr().out)
    for side in ("hicache", "hicache_file"):
        assert doc[side]["pages_put"] == doc[side]["pages_got"] == pages * repeats
    assert doc["hicache_store_pages_written"] == pages * (repeats + 1) + 1
    hi, hf = doc["hicache"], doc["hicache_file"]
    for op in ("put", "get"):
        # figures and ratios are each rounded to 4 significant digits
        assert doc["ratios"][op] == pytest.approx(hi[f"{op}_gbps"] / hf[f"{op}_gbps"], rel=2e-3)


@pytest.mark.parametrize(
    "args",
    [["--pages", "0"], ["--pages", "1000000000000"], ["--layers", "-1"], ["--layout", "nope"]],
)
def test_bench_sglang_bad_option_is_one_line_exit_2(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    with pytest.raises(SystemExit) if args[0] == "--layout" else contextlib.nullcontext():
        assert main(["bench", "sglang", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert args[0].lstrip("-") in err
