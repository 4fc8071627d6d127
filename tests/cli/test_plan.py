"""`hicache plan`: flags, the JSON document, exit statuses, one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hicache.cli import main
from tests.domain.fixture_expectations import EXPECTED, actual_document, expected_document

TOP_KEYS = {
    "model_type",
    "tp_size",
    "page_size",
    "layout",
    "host_memory",
    "transfer_layers",
    "host_bytes_total",
    "pools",
}
POOL_KEYS = {
    "name",
    "role",
    "layers",
    "unit",
    "bytes_per_unit_per_layer",
    "capacity",
    "bytes",
    "layout",
    "host_memory",
    "binding",
}
QWEN3_NEXT = "qwen3-next-80b-a3b-instruct"
LLAMA = "llama-3.1-8b-instruct"


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors leave through SystemExit(2)
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = run(["plan", *args, "--json"], capsys)
    assert (code, err) == (0, "")
    doc: dict[str, Any] = json.loads(out)  # exactly one document: extra data would not parse
    return doc


def pools(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in doc["pools"]}


def test_json_document_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", QWEN3_NEXT)
    assert doc.keys() >= TOP_KEYS
    assert set(doc["host_memory"]) == {"kind", "pinned"}
    for p in doc["pools"]:
        assert p.keys() >= POOL_KEYS
        assert p["unit"] in ("token", "slot")
        assert set(p["host_memory"]) == {"kind", "pinned"}
        assert all(k.isdigit() and isinstance(v, int) for k, v in p["binding"].items())
    assert doc["host_bytes_total"] == sum(p["bytes"] for p in doc["pools"])


@pytest.mark.parametrize(("name", "tp"), sorted(EXPECTED))
def test_every_fixture_at_tp_1_and_8(
    capsys: pytest.CaptureFixture[str], name: str, tp: int
) -> None:
    doc = plan_json(capsys, "--model", name, "--tp", str(tp))
    assert actual_document(doc) == expected_document(name, tp)


def test_human_output_is_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["plan", "--model", QWEN3_NEXT], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("qwen3_next  archetype=kv_state  tp=1")
    header = lines[2].split()
    assert header[:3] == ["pool", "role", "kind"]
    assert lines[3].split()[:4] == ["kv", "anchor", "mha", "12"]
    assert lines[4].split()[:4] == ["mamba", "independent", "state", "36"]
    assert lines[-1].startswith("total host bytes: ")


def test_model_from_a_path_or_a_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "num_hidden_layers": 2,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 64,
                "hidden_size": 512,
            }
        )
    )
    for model in (str(config), str(tmp_path)):
        doc = plan_json(capsys, "--model", model)
        assert pools(doc)["kv"]["bytes_per_unit_per_layer"] == 2 * 4 * 64 * 2
    assert plan_json(capsys, "--model", f"{LLAMA}.json")["model_type"] == "llama"


def test_parallelism_page_size_and_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(
        capsys,
        "--model",
        QWEN3_NEXT,
        "--tp",
        "8",
        "--pp-size",
        "4",
        "--pp-rank",
        "3",
        "--page-size",
        "32",
        "--layout",
        "page_head",
        "--pool-layout",
        "mamba=page_first_direct",
    )
    assert (doc["tp_size"], doc["page_size"], doc["layout"]) == (8, 32, "page_head")
    assert doc["stage"] == [36, 48]
    kv, mamba = pools(doc)["kv"], pools(doc)["mamba"]
    assert kv["binding"] == {"3": 0, "7": 1, "11": 2}  # global layers 39, 43, 47
    assert (kv["layout"], mamba["layout"]) == ("page_head", "page_first_direct")
    assert mamba["layers"] == 9


def test_sizing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(
        capsys, "--model", QWEN3_NEXT, "--device-tokens", "1024", "--device-slots", "10"
    )
    # 1024 x 2 / 64 = 32 pages; 10 x 2 slots
    assert (pools(doc)["kv"]["capacity"], pools(doc)["mamba"]["capacity"]) == (2048, 20)
    doc = plan_json(capsys, "--model", LLAMA, "--host-ratio", "0.5")
    assert pools(doc)["kv"]["capacity"] == 32768
    doc = plan_json(capsys, "--model", QWEN3_NEXT, "--host-size", "20GiB")
    assert doc["host_bytes_total"] <= 20 << 30
    assert all(p["capacity"] % (64 if p["unit"] == "token" else 1) == 0 for p in doc["pools"])
    doc = plan_json(capsys, "--model", QWEN3_NEXT, "--host-size", "20GiB", "--capacity", "mamba=64")
    assert pools(doc)["mamba"]["capacity"] == 64
    assert doc["host_bytes_total"] <= 20 << 30


def test_swa_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "gpt-oss-20b", "--swa-tokens", "4096")
    assert (pools(doc)["kv"]["capacity"], pools(doc)["swa"]["capacity"]) == (131072, 8192)


def test_dtypes_and_pinning(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", QWEN3_NEXT, "--kv-dtype", "fp8", "--ssm-dtype", "bf16")
    assert pools(doc)["kv"]["bytes_per_unit_per_layer"] == 2 * 2 * 256 * 1
    assert pools(doc)["mamba"]["bytes_per_unit_per_layer"] == (
        (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 2
    )
    assert plan_json(capsys, "--model", LLAMA, "--pinned")["host_memory"]["pinned"] is True
    assert plan_json(capsys, "--model", LLAMA, "--no-pinned")["host_memory"]["pinned"] is False
    assert plan_json(capsys, "--model", LLAMA)["host_memory"]["pinned"] == "auto"


@pytest.mark.parametrize(
    "extra",
    ['{"allocator": "shm"}', "@TMP/extra.toml", "@TMP/extra.yaml", "@TMP/extra.json"],
)
def test_dynamic_shm_reaches_every_pool(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: str
) -> None:
    (tmp_path / "extra.toml").write_text('allocator = "shm"\n')
    (tmp_path / "extra.yaml").write_text("allocator: shm\n")
    (tmp_path / "extra.json").write_text('{"allocator": "shm"}')
    for model in (QWEN3_NEXT, "deepseek-v3.2-exp", "gpt-oss-20b"):
        doc = plan_json(
            capsys,
            "--model",
            model,
            "--storage-backend",
            "dynamic",
            "--storage-extra-config",
            extra.replace("TMP", str(tmp_path)),
        )
        assert doc["host_memory"]["kind"] == "shm"
        assert {p["host_memory"]["kind"] for p in doc["pools"]} == {"shm"}


def test_storage_backends(capsys: pytest.CaptureFixture[str]) -> None:
    kinds = {
        backend: plan_json(capsys, "--model", LLAMA, "--storage-backend", backend)["host_memory"][
            "kind"
        ]
        for backend in ("shm", "mooncake", "file")
    }
    assert kinds == {"shm": "shm", "mooncake": "store:mooncake", "file": "anonymous"}


def test_host_check_passes_when_the_plan_fits(capsys: pytest.CaptureFixture[str]) -> None:
    # llama at tp 8: 2 GiB per rank; 8 ranks + 10 GiB reserve fit in 32 GiB
    doc = plan_json(
        capsys, "--model", LLAMA, "--tp", "8", "--host-available", "32GiB", "--ranks-per-host", "8"
    )
    assert doc["host_bytes_total"] == 2 << 30


BAD_FILES = {
    "bert.json": b'{"model_type": "bert"}',
    "binary.json": b"\xff\xfe\x00\x01",
    "broken.json": b"{",
}


def bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Case -> (argv, a piece of the one-line message that must name the problem)."""
    unsupported, binary, not_json = (str(tmp / n) for n in BAD_FILES)
    m = ["plan", "--model", LLAMA]
    return {
        "unknown model": (["plan", "--model", "gpt-5"], "'gpt-5' is neither"),
        "unsupported type": (["plan", "--model", unsupported], "unsupported model type 'bert'"),
        "binary model": (["plan", "--model", binary], "not UTF-8"),
        "broken model": (["plan", "--model", not_json], "is not valid JSON"),
        "missing model": (["plan"], "--model"),
        "tp not dividing": ([*m, "--tp", "3"], "8 heads can be neither split"),
        "tp zero": ([*m, "--tp", "0"], "tp_size must be a positive integer"),
        "tp not a number": ([*m, "--tp", "abc"], "invalid int value: 'abc'"),
        "pp rank": ([*m, "--pp-size", "2", "--pp-rank", "2"], "pp_rank must be in [0, 2)"),
        "bad layout": ([*m, "--layout", "diagonal"], "unknown layout 'diagonal'"),
        "bad pool layout": ([*m, "--pool-layout", "kv"], "--pool-layout expects POOL=VALUE"),
        "malformed extra": (
            [*m, "--storage-backend", "dynamic", "--storage-extra-config", '{"allocator": shm}'],
            "not valid JSON",
        ),
        "unknown allocator": (
            [*m, "--storage-backend", "dynamic", "--storage-extra-config", '{"allocator": "hp"}'],
            "unknown allocator 'hp'",
        ),
        "unreadable extra file": (
            [*m, "--storage-backend", "dynamic", "--storage-extra-config", f"@{tmp}/no.toml"],
            "cannot read extra config file",
        ),
        "unknown backend": ([*m, "--storage-backend", "redis"], "unknown storage backend 'redis'"),
        "host size garbage": ([*m, "--host-size", "lots"], "cannot read size 'lots'"),
        "size and ratio": ([*m, "--host-size", "1GiB", "--host-ratio", "2"], "not allowed with"),
        "bad ratio": ([*m, "--host-ratio", "-1"], "host ratio must be a positive number"),
        "layer_first state": (
            ["plan", "--model", QWEN3_NEXT, "--layout", "layer_first"],
            "pool 'mamba' holds recurrent state",
        ),
        "layer_first mooncake": (
            [*m, "--layout", "layer_first", "--storage-backend", "mooncake"],
            "storage backend 'mooncake' moves whole pages",
        ),
        "page_head mla": (
            ["plan", "--model", "deepseek-v3", "--layout", "page_head"],
            "without a head axis",
        ),
        "bad dtype": ([*m, "--kv-dtype", "float64"], "unknown dtype 'float64'"),
        "bad capacity": ([*m, "--capacity", "kv=lots"], "whole number of units, got 'lots'"),
        "capacity not pages": ([*m, "--capacity", "kv=100"], "whole number of pages of 64"),
        "capacity unknown pool": (
            [*m, "--capacity", "swa=64"],
            "which model 'llama' does not have",
        ),
        "tiny device": (
            [*m, "--device-tokens", "16"],
            "device_tokens=16 is not a whole number of pages of 64 tokens; use 64",
        ),
        "partial page": ([*m, "--device-tokens", "1000"], "use 960 or 1024"),
        "host too small": ([*m, "--host-available", "20GiB"], "only 10737418240 B are usable"),
        "pp start alone": ([*m, "--pp-start", "4"], "pp_start and pp_end come together"),
        "pp range outside": (
            [*m, "--pp-start", "4", "--pp-end", "40"],
            "[4, 40) is not a non-empty range of the model's 32 layers",
        ),
        "bad pp split": ([*m, "--pp-split", "even"], "pp_split must be 'vllm' or 'sglang'"),
        "state-only stage": (
            ["plan", "--model", "qwen3.5-35b-a3b", "--pp-size", "20"],
            "pp sizes whose every stage has one under the vllm split: 1, 2, 3",
        ),
    }


BAD_CASES = sorted(bad_inputs(Path("/nonexistent")))


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, case: str
) -> None:
    for name, data in BAD_FILES.items():
        (tmp_path / name).write_bytes(data)
    argv, fragment = bad_inputs(tmp_path)[case]
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.endswith("\n")
    assert err.count("\n") == 1, err
    assert err.startswith("hicache: error: ")
    assert fragment in err
    assert "Traceback" not in err


def subprocess_env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def test_a_real_process_prints_one_json_document() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hicache", "plan", "--model", QWEN3_NEXT, "--tp", "8", "--json"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    doc = json.loads(proc.stdout)
    assert actual_document(doc) == expected_document(QWEN3_NEXT, 8)


def test_a_real_process_reports_bad_input_on_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hicache",
            "plan",
            "--model",
            LLAMA,
            "--storage-backend",
            "dynamic",
            "--storage-extra-config",
            f"@{tmp_path}/missing.yaml",
            "--json",
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "missing.yaml" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("model", "expected"),
    [("minimax-m3", {"kv", "indexer"}), ("inkling", {"kv", "swa", "mamba"})],
)
def test_dynamic_shm_gives_shm_to_every_pool_of_the_allocator_story_stacks(
    capsys: pytest.CaptureFixture[str], model: str, expected: set[str]
) -> None:
    doc = plan_json(
        capsys,
        "--model",
        model,
        "--storage-backend",
        "dynamic",
        "--storage-extra-config",
        '{"allocator": "shm"}',
    )
    assert doc["host_memory"]["kind"] == "shm"
    assert {p["name"]: p["host_memory"]["kind"] for p in doc["pools"]} == dict.fromkeys(
        expected, "shm"
    )


def test_pp_flags_choose_the_stage(capsys: pytest.CaptureFixture[str]) -> None:
    # 32 layers over 3 stages: vLLM gives the 2 extra layers to ranks 0 and 1 (sizes 11, 11, 10),
    # SGLang to the last two (10, 11, 11)
    base = ["--model", LLAMA, "--pp-size", "3", "--pp-rank", "1"]
    assert plan_json(capsys, *base)["stage"] == [11, 22]
    assert plan_json(capsys, *base, "--pp-split", "sglang")["stage"] == [10, 21]
    doc = plan_json(capsys, "--model", LLAMA, "--pp-start", "5", "--pp-end", "9")
    assert (doc["stage"], doc["transfer_layers"]) == ([5, 9], 4)
