"""`hicache bench cache`: the JSON document's shape (never its timings), the table, bad input."""

from __future__ import annotations

import json

import pytest

from hicache.cli import main

TINY = [
    "--pages-max",
    "1500",
    "--tokens",
    "512",
    "--batch",
    "16",
    "--repeats",
    "3",
    "--request-page-sizes",
    "1,16",
    "--long-prompt",
    "4096",
]


def test_json_is_one_document_with_both_index_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cache", "--json", *TINY]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {
        "hash_tokens_per_s",
        "match_us_per_page",
        "insert_us_per_page",
        "page_size",
        "request_ms",
        "long_prompt_ms",
        "long_prompt_insert_ms",
        "long_prompt_tokens",
        "key_hasher",
    }
    assert doc["hash_tokens_per_s"] > 0
    assert set(doc["match_us_per_page"]) == {"1000", "1500"}
    assert set(doc["insert_us_per_page"]) == {"1000", "1500"}
    assert all(v > 0 for v in doc["match_us_per_page"].values())
    assert doc["page_size"] == 64
    assert set(doc["request_ms"]) == {"1", "16"}
    assert set(doc["long_prompt_ms"]) == set(doc["long_prompt_insert_ms"]) == {"1", "16", "64"}
    assert doc["long_prompt_tokens"] == 4096
    assert doc["key_hasher"] in {"python", "native-sha-ni", "native-portable"}


def test_python_keys_runs_the_python_chain(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cache", "--json", "--python-keys", *TINY]) == 0
    assert json.loads(capsys.readouterr().out)["key_hasher"] == "python"


def test_a_tiny_index_reports_one_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cache", "--json", *TINY[2:], "--pages-max", "200"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["match_us_per_page"]) == {"200"}


def test_the_table_names_each_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cache", *TINY]) == 0
    out = capsys.readouterr().out
    assert "M tokens/s at page size 64" in out
    assert "1,500" in out
    assert "512-token request at page size 16" in out
    assert "4,096-token prompt at page size 1: hash + match" in out


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--pages-max", "0", "--pages-max must be a positive integer, got 0"),
        ("--batch", "-3", "--batch must be a positive integer, got -3"),
        ("--request-page-sizes", "1,x", "--request-page-sizes '1,x'"),
        ("--long-prompt", "0", "--long-prompt must be a positive integer, got 0"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, message: str
) -> None:
    assert main(["bench", "cache", *TINY, flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert message in err
