"""`hicache bench overlap`: a smoke run with tiny sizes (keys and types, never timings)."""

from __future__ import annotations

import json

import pytest

from hicache.bench.overlap import KEYS, bench_plan
from hicache.cli import main
from hicache.domain import ConfigError

TINY = ["--layers", "3", "--tokens", "128", "--page-size", "64", "--repeats", "1"]


def test_json_document_has_exactly_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overlap", "--json", *TINY]) == 0
    out, _ = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1  # one JSON document, nothing else on stdout
    doc = json.loads(lines[0])
    assert tuple(doc) == KEYS
    assert doc["device"] == "cpu"
    assert doc["layers"] == 3
    for key in KEYS[2:]:
        assert isinstance(doc[key], float), key
    assert doc["transfer_ms"] > 0
    assert doc["compute_ms"] > 0


def test_human_summary_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overlap", *TINY]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("hicache bench overlap on cpu: 3 layers")
    assert "exposed fraction" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--layers", "0"], "--layers must be a positive integer, got 0"),
        (["--tokens", "100"], "--tokens 100 must be a whole number of pages"),
        (["--repeats", "0"], "--repeats must be a positive integer"),
        (["--layout", "diagonal"], "unknown layout 'diagonal'"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "overlap", "--json", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_bench_plan_is_one_kv_pool() -> None:
    plan = bench_plan(layers=4, tokens=256, page_size=64, layout="page_first")
    assert plan.transfer_layers == 4
    assert plan.anchor.bytes_per_unit_per_layer == 2048
    assert plan.anchor.pages == 4
    with pytest.raises(ConfigError):
        bench_plan(layers=4, tokens=256, page_size=0, layout="page_first")


def test_the_command_puts_the_logging_configuration_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import structlog

    before = structlog.is_configured()
    assert main(["bench", "overlap", "--json", *TINY]) == 0
    capsys.readouterr()
    assert structlog.is_configured() == before
    with structlog.testing.capture_logs() as logs:
        structlog.get_logger("hicache.engine").debug("still_seen")
    assert [e["event"] for e in logs] == ["still_seen"]


def test_timeline_adds_one_stamped_round_per_layer_in_order(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "overlap", "--json", "--timeline", *TINY]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert tuple(doc) == (*KEYS, "timeline")
    t = doc["timeline"]
    assert set(t) == {"submit", "layers", "exposed_ms", "first_copy_ms"}
    assert [row["layer"] for row in t["layers"]] == [0, 1, 2]
    submit_end = t["submit"][1]
    assert t["first_copy_ms"] == t["layers"][0]["copy"][0]
    for row in t["layers"]:
        (c0, c1), (w0, w1), (k0, k1) = row["copy"], row["wait"], row["compute"]
        assert 0 <= c0 <= c1  # the worker copied this layer, start before end
        assert submit_end <= w0 <= w1 == k0 <= k1  # wait, then compute, after the submission
        assert c1 <= w1 + 1e-3  # the wait returned only once the copy had ended (stamp rounding)
    assert t["exposed_ms"] == pytest.approx(
        sum(r["wait"][1] - r["wait"][0] for r in t["layers"]), abs=1e-2
    )


def test_without_timeline_the_document_has_no_timeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "overlap", "--json", *TINY]) == 0
    assert "timeline" not in json.loads(capsys.readouterr().out)
