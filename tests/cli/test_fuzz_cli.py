"""Hostile command lines: every one exits 2 with exactly one line on stderr, no traceback, no hang.

Hand-written cases cover each input class of issue 12 (deep JSON, huge integers, Infinity/NaN,
absurd sizes, zero and negative counts, wrong types in model files, FIFOs and devices as files,
over-long paths, broken JSON/TOML/YAML), and every count of the newer commands (bench cache,
storage, soak, scale, engine, demo: each has a ceiling named in its message, issue 20); issue 27
adds keys given twice, non-string keys, empty list items, and `hicache config --show` with
hostile HICACHE_* variables and config files (deep JSON, seconds past 1e6, 400-digit integers,
nested + dotted forms of one key, runtime values out of range);
hypothesis adds random values for the numeric and string flags of `hicache plan`. The cases run in-process through ``hicache.cli.main``; a few run
through a real subprocess to check the exit status and stderr end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.cli import main

pytestmark = pytest.mark.timeout(60)

LLAMA = ["plan", "--model", "llama-3.1-8b-instruct"]
FIXTURES = Path(__file__).resolve().parents[2] / "src" / "hicache" / "fixtures" / "models"
HUGE = "9" * 5000
BIG = "1" + "0" * 30

INT_VALUES = ["0", "-1", "1.5", "true", "1e308", "inf", "nan", HUGE, BIG, "", "0x10", "1_0x"]
POSITIVE_INT_FLAGS = [
    "--tp",
    "--pp-size",
    "--page-size",
    "--device-tokens",
    "--device-slots",
    "--swa-tokens",
    "--ranks-per-host",
]
RATIO_VALUES = ["0", "-1", "inf", "nan", "1e308", "1e400", "x", HUGE, "1e7", "-inf", ""]
SIZE_VALUES = [
    "0",
    "-1",
    "1e308",
    HUGE,
    BIG + "GiB",
    "64XB",
    "inf",
    "nan",
    "",
    " ",
    "1.5.5GiB",
    "2EiB",
    "99999999TiB",
]
STRING_FLAGS = {
    "--layout": ["", "nope", "a" * 5000, "\x00", "page-first-direct!", "1"],
    "--pool-layout": [
        "",
        "=",
        "kv=",
        "=page_first",
        "kv=nope",
        "nope=page_first",
        "kv=page_first=x",
    ],
    "--capacity": [
        "",
        "kv",
        "kv=",
        "kv=x",
        f"kv={HUGE}",
        f"kv={BIG}",
        "kv=0",
        "kv=-64",
        "kv=1.5",
        "swa=64",
    ],
    "--pp-split": ["", "nope", "VLLMX"],
    "--kv-dtype": ["nope", "float64", "int4"],
    "--ssm-dtype": ["", "nope", "float64"],
    "--storage-backend": ["nope", "SHM ", "dynamic"],
}
EXTRA_INLINE = [
    "[" * 100_000,
    "[" * 50_000 + "]" * 50_000,
    '{"a":' * 20_000 + "1" + "}" * 20_000,
    '{"allocator": ' + HUGE + "}",
    '{"allocator": "shm", "x": Infinity}',
    '{"allocator": "shm", "x": NaN}',
    '{"allocator": "shm", "x": 1e400}',
    '{"allocator": "shm", "x": -Infinity}',
    '{"allocator": "shm", "allocator": "anonymous"}',  # a key given twice
    "[]",
    "1",
    "null",
    "{",
    '{"allocator": 5}',
    '{"allocator": "nope"}',
    '{"allocator": null}',
    '{"allocator": ["shm"]}',
    "{}",
    '"shm"',
]


def _cases(tmp: Path, create: bool) -> list[list[str]]:
    """Every hand-written case; ``create`` writes the files they name (False: names only)."""
    _MAKE[0] = create
    cases: list[list[str]] = []
    for flag in POSITIVE_INT_FLAGS:
        cases += [[*LLAMA, flag, v] for v in INT_VALUES]
    cases += [[*LLAMA, "--pp-size", "2", "--pp-rank", v] for v in ["-1", "2", HUGE, BIG, "x"]]
    cases += [[*LLAMA, "--pp-start", "0", "--pp-end", v] for v in ["0", "-1", "33", BIG, "x"]]
    cases += [[*LLAMA, "--host-ratio", v] for v in RATIO_VALUES]
    for flag in ("--host-size", "--host-available", "--reserve"):
        cases += [[*LLAMA, flag, v] for v in SIZE_VALUES]
    for flag, values in STRING_FLAGS.items():
        cases += [[*LLAMA, flag, v] for v in values]
    cases += [
        [*LLAMA, "--storage-backend", "dynamic", "--storage-extra-config", v] for v in EXTRA_INLINE
    ]
    for path in _bad_files(tmp):
        cases.append([*LLAMA, "--storage-backend", "dynamic", "--storage-extra-config", f"@{path}"])
    for path in _bad_models(tmp):
        cases.append(["plan", "--model", str(path)])
    cases += _bench_and_demo_cases()
    return cases


_MAKE = [False]


def _write(path: Path, text: str | bytes) -> Path:
    if not _MAKE[0]:
        return path
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _bad_files(tmp: Path) -> list[str]:
    fifo = tmp / "fifo.json"
    if _MAKE[0] and not fifo.exists():
        os.mkfifo(fifo)
    return [
        str(fifo),
        "/dev/zero",
        "/dev/null",
        str(tmp),
        str(tmp / "missing.json"),
        "/" + "a" * 5000 + ".json",
        "/" + "a/" * 3000 + "x.json",
        str(_write(tmp / "deep.json", "[" * 100_000 + "]" * 100_000)),
        str(_write(tmp / "bigint.json", '{"allocator": ' + HUGE + "}")),
        str(_write(tmp / "inf.json", '{"allocator": "shm", "x": Infinity}')),
        str(_write(tmp / "list.json", "[1, 2]")),
        str(_write(tmp / "binary.json", bytes(range(256)))),
        str(_write(tmp / "broken.yaml", "a: [1, 2\nb: {c\n")),
        str(_write(tmp / "deep.yaml", "[" * 50_000 + "]" * 50_000)),
        str(_write(tmp / "inf.yaml", "allocator: shm\nx: .inf\n")),
        str(_write(tmp / "nan.yaml", "allocator: shm\nx: .nan\n")),
        str(_write(tmp / "huge.yaml", f"allocator: shm\nx: {HUGE[:4000]}\n")),
        str(_write(tmp / "list.yaml", "- 1\n- 2\n")),
        str(_write(tmp / "dup.json", '{"allocator": "shm", "allocator": "anonymous"}')),
        str(_write(tmp / "dup.yaml", "allocator: shm\nallocator: anonymous\n")),
        str(_write(tmp / "intkeys.yaml", "allocator: shm\n1: 2\n")),
        str(_write(tmp / "bomb.yaml", _yaml_bomb())),
        str(_write(tmp / "broken.toml", "a = [1,\n")),
        str(_write(tmp / "inf.toml", 'allocator = "shm"\nx = inf\n')),
        str(_write(tmp / "deep.toml", "a = " + "[" * 5000 + "]" * 5000 + "\n")),
        str(_write(tmp / "config.ini", "[x]\n")),
        str(_write(tmp / "huge.json", b" " * (17 << 20))),
    ]


def _yaml_bomb() -> str:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x","x"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 10) + "]")
        prev = name
    return "\n".join(lines) + "\nallocator: shm\n"


LLAMA_CONFIG = json.loads((FIXTURES / "llama-3.1-8b-instruct.json").read_text())
QWEN_NEXT = json.loads((FIXTURES / "qwen3-next-80b-a3b-instruct.json").read_text())
DEEPSEEK = json.loads((FIXTURES / "deepseek-v3.json").read_text())


def _bad_models(tmp: Path) -> list[str]:
    fifo = tmp / "model-fifo"
    if _MAKE[0] and not fifo.exists():
        os.mkfifo(fifo)
    variants = {
        "layers-1e9": {**LLAMA_CONFIG, "num_hidden_layers": 10**9},
        "layers-1e12": {**LLAMA_CONFIG, "num_hidden_layers": 10**12},
        "heads-zero": {**LLAMA_CONFIG, "num_key_value_heads": 0},
        "heads-true": {**LLAMA_CONFIG, "num_key_value_heads": True},
        "heads-float": {**LLAMA_CONFIG, "num_key_value_heads": 8.9},
        "heads-string": {**LLAMA_CONFIG, "num_key_value_heads": "8"},
        "heads-negative": {**LLAMA_CONFIG, "num_key_value_heads": -8},
        "head-dim-zero": {**LLAMA_CONFIG, "head_dim": 0},
        "head-dim-true": {**LLAMA_CONFIG, "head_dim": True},
        "attention-heads-zero": {**LLAMA_CONFIG, "num_attention_heads": 0},
        "interval-zero": {**QWEN_NEXT, "full_attention_interval": 0},
        "interval-float": {**QWEN_NEXT, "full_attention_interval": 4.0},
        "deepseek-layer-types": {**DEEPSEEK, "layer_types": ["sliding_attention"] * 61},
        "dtype-number": {**LLAMA_CONFIG, "torch_dtype": 16},
        "text-config-list": {**LLAMA_CONFIG, "text_config": [1]},
    }
    paths = [str(_write(tmp / f"{k}.json", json.dumps(v))) for k, v in variants.items()]
    return [
        *paths,
        str(fifo),
        "/dev/zero",
        str(_write(tmp / "deep-model.json", "[" * 100_000 + "]" * 100_000)),
        str(_write(tmp / "inf-model.json", json.dumps(LLAMA_CONFIG)[:-1] + ', "x": Infinity}')),
        str(_write(tmp / "big-model.json", json.dumps(LLAMA_CONFIG)[:-1] + f', "x": {HUGE}}}')),
        "/" + "m" * 5000,
        "m/" * 3000,
        "nope-not-a-model",
        str(_write(tmp / "array-model.json", "[]")),
    ]


def _bench_and_demo_cases() -> list[list[str]]:
    return [
        ["bench", "copy", "--layers", "1000000000", "--tokens", "64", "--page-sizes", "1"],
        ["bench", "copy", "--tokens", "1000000000000", "--page-sizes", "1"],
        ["bench", "copy", "--layers", "1000000000000"],
        ["bench", "copy", "--repeats", "1000000000000"],
        ["bench", "copy", "--repeats", "0"],
        ["bench", "copy", "--tokens", "0"],
        ["bench", "copy", "--tokens", HUGE],
        ["bench", "copy", "--page-sizes", HUGE],
        ["bench", "copy", "--page-sizes", ",,"],
        ["bench", "copy", "--page-sizes", "0"],
        ["bench", "copy", "--page-sizes", "3"],
        ["bench", "copy", "--layouts", "nope"],
        ["bench", "copy", "--layouts", ","],
        ["bench", "copy", "--backend", "nope"],
        ["bench", "copy", "--host-memory", "nope"],
        ["bench", "overlap", "--layers", "1000000000000"],
        ["bench", "overlap", "--layers", "1000000000"],
        ["bench", "overlap", "--tokens", "1000000000000", "--page-size", "1"],
        ["bench", "overlap", "--tokens", "1000000000", "--page-size", "1"],
        ["bench", "overlap", "--tokens", "100", "--page-size", "64"],
        ["bench", "overlap", "--page-size", "0"],
        ["bench", "overlap", "--repeats", "1000000000000"],
        ["bench", "overlap", "--layout", "nope", "--layers", "2", "--tokens", "64"],
        ["bench", "engine", "--rounds", "1000000000000"],
        ["bench", "engine", "--rounds", "0"],
        ["bench", "engine", "--rounds", "-3"],
        ["demo", "--turns", "1000000000"],
        ["demo", "--turns", "0"],
        ["demo", "--prefix-tokens", "1000000000000"],
        ["demo", "--prefix-tokens", "100"],
        ["demo", "--storage", "nope"],
        *_newer_bench_cases(),
        ["shm"],
        ["shm", "nope"],
        ["bench"],
        ["nope"],
        [],
    ]


# Counts of the newer bench commands: each has a ceiling named in its message (issue 20).
NEWER_COUNTS = {
    ("bench", "cache"): ["--pages-max", "--tokens", "--page-size", "--batch", "--repeats"],
    ("bench", "storage"): ["--pages", "--page-size", "--layers", "--repeats"],
    ("bench", "soak"): ["--ops", "--concurrency"],
    ("bench", "scale"): ["--max-pages", "--repeats"],
    ("bench", "engine"): ["--rounds"],
    ("demo",): ["--turns", "--prefix-tokens"],
}
COUNT_VALUES = ["0", "-1", "1.5", "x", "", "1000000000000", HUGE, "nan"]


def _newer_bench_cases() -> list[list[str]]:
    cases = [
        [*cmd, flag, v]
        for cmd, flags in NEWER_COUNTS.items()
        for flag in flags
        for v in COUNT_VALUES
    ]
    return [
        *cases,
        ["bench", "cache", "--tokens", "64", "--page-size", "128"],  # a page beyond the request
        ["bench", "cache", "--pages-max", "10", "--batch", "11"],
        ["bench", "cache", "--request-page-sizes", "0"],
        ["bench", "cache", "--request-page-sizes", "99999999"],
        ["bench", "cache", "--request-page-sizes", ",".join(["1"] * 17)],
        ["bench", "cache", "--request-page-sizes", "a,b"],
        ["bench", "cache", "--request-page-sizes", "1,,16"],  # an empty item: refused, no run
        ["bench", "cache", "--request-page-sizes", "1,16,"],
        ["bench", "cache", "--request-page-sizes", ",1"],
        ["bench", "cache", "--request-page-sizes", " "],
        ["bench", "copy", "--page-sizes", "1,,16"],
        ["bench", "copy", "--layouts", "layer_first,,page_first"],
        ["bench", "storage", "--pages", "65536", "--page-size", "65536"],  # past the machine
        ["bench", "storage", "--store", "nope"],
        ["bench", "storage", "--layout", "nope"],
        ["bench", "storage", "--store", "directory", "--store-config", "{"],
        ["bench", "storage", "--store", "directory", "--store-config", '{"root": "a\u0000b"}'],
        ["bench", "storage", "--store", "directory", "--store-config", '{"capacity_bytes": 1.5}'],
        ["bench", "soak", "--seed", "-1"],
        ["bench", "soak", "--seed", HUGE],
        ["bench", "scale", "--max-bytes", "0"],
        ["bench", "scale", "--max-bytes", "1000000000000000"],
        ["bench", "scale", "--max-bytes", "nope"],
        ["demo", "--device", "nope"],
        ["demo", "--plot", "/nonexistent-dir/x.png", "--turns", "0"],
    ]


@pytest.fixture(scope="module")
def hostile_cases(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    return _cases(tmp_path_factory.mktemp("hostile"), create=True)


def _ids(cases: list[list[str]]) -> Iterator[str]:
    for i, argv in enumerate(cases):
        text = " ".join(a if len(a) <= 24 else a[:21] + "..." for a in argv)
        yield f"{i:03d}:{text}"


_CASES = _cases(Path("/nonexistent-hostile-dir"), create=False)  # for the ids only


def check_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        rc = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    lines = err.strip("\n").split("\n")
    assert rc == 2, f"{argv[:6]} exited {rc}: {err[-500:]}"
    assert len(lines) == 1, f"{argv[:6]} printed {len(lines)} lines on stderr: {err[-800:]}"
    assert lines[0].startswith("hicache: error: ") or lines[0].startswith("usage:"), lines[0][:200]
    assert "Traceback" not in err


@pytest.mark.parametrize("index", range(len(_CASES)), ids=list(_ids(_CASES)))
def test_hostile_command_line_is_one_line_exit_2(
    index: int, hostile_cases: list[list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    check_usage_error(hostile_cases[index], capsys)


NUMERIC_FLAGS = [*POSITIVE_INT_FLAGS, "--pp-rank", "--host-ratio", "--host-size", "--reserve"]


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    flag=st.sampled_from(NUMERIC_FLAGS),
    value=st.one_of(
        st.integers(min_value=-(10**40), max_value=10**40).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(max_size=40).filter(lambda t: not t.startswith("-") or t[1:2].isdigit()),
    ),
)
def test_random_numeric_flags_plan_or_exit_2_in_one_line(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value either plans (exit 0, a JSON document) or is refused in one line with exit 2."""
    try:
        rc = main([*LLAMA, "--json", flag, value])
    except SystemExit as e:
        rc = e.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    if rc == 0:
        json.loads(out)
        return
    assert rc == 2, (flag, value, err[-300:])
    assert len(err.strip("\n").split("\n")) == 1, err[-500:]
    assert "Traceback" not in err


def _subprocess(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hicache", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )


def test_a_fifo_or_dev_zero_as_a_file_is_refused_end_to_end(tmp_path: Path) -> None:
    fifo = tmp_path / "extra.json"
    os.mkfifo(fifo)
    for argv in (
        [*LLAMA, "--storage-backend", "dynamic", "--storage-extra-config", f"@{fifo}"],
        ["plan", "--model", "/dev/zero"],
        ["plan", "--model", str(fifo)],
    ):
        proc = _subprocess(argv)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1
        assert "not a regular file" in proc.stderr


def test_deep_json_huge_numbers_and_long_paths_end_to_end() -> None:
    for argv, words in (
        ([*LLAMA, "--storage-extra-config", "[" * 100_000], "nested too deeply"),
        ([*LLAMA, "--storage-extra-config", '{"x": ' + HUGE + "}"], "5000 digits"),
        (["plan", "--model", "/" + "a" * 5000], "File name too long"),
        ([*LLAMA, "--host-ratio", "1e308"], "host ratio must be at most"),
        (["bench", "copy", "--layers", "1000000000000"], "--layers must be at most"),
    ):
        proc = _subprocess(argv)
        assert proc.returncode == 2, (argv[:4], proc.stderr[-300:])
        assert proc.stderr.count("\n") == 1, proc.stderr[-600:]
        assert words in proc.stderr
        assert proc.stdout == ""


def test_absurd_bench_sizes_name_the_value_and_the_machine_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "copy", "--layers", "4096", "--tokens", "1048576"]) == 2
    err = capsys.readouterr().err
    assert "needs 52776558133248 B of host memory" in err
    assert "available (limit" in err


BIG400 = "1" + "0" * 400
DEEP_JSON = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
CONFIG_ENV_CASES = {
    "deep extra config": ("HICACHE_STORAGE_EXTRA_CONFIG", DEEP_JSON),
    "deep pool layouts": ("HICACHE_PLAN_POOL_LAYOUTS", DEEP_JSON),
    "deep copy backend": ("HICACHE_COPY_BACKEND", DEEP_JSON),
    "deadline 1e308": ("HICACHE_STORAGE_TIER_CALL_DEADLINE_S", "1e308"),
    "deadline 1e400": ("HICACHE_STORAGE_TIER_CALL_DEADLINE_S", "1e400"),
    "deadline 400 digits": ("HICACHE_STORAGE_TIER_CALL_DEADLINE_S", BIG400),
    "cooldown inf": ("HICACHE_STORAGE_TIER_BREAKER_COOLDOWN_S", "inf"),
    "timeout nan": ("HICACHE_STORAGE_TIER_TIMEOUT_MAX_S", "nan"),
    "host ratio 400 digits": ("HICACHE_PLAN_HOST_RATIO", BIG400),
    "event sets -1": ("HICACHE_RUNTIME_EVENT_SETS", "-1"),
    "event sets 400 digits": ("HICACHE_RUNTIME_EVENT_SETS", BIG400),
    "duplicate extra key": ("HICACHE_STORAGE_EXTRA_CONFIG", '{"root": "/a", "root": "/b"}'),
    "extra as pairs": ("HICACHE_STORAGE_EXTRA_CONFIG", '[["root", "/a"]]'),
}
CONFIG_FILE_CASES = {
    "dup.json": '{"storage": {"backend": "shm", "backend": "directory"}}',
    "dup.yaml": "storage:\n  backend: shm\n  backend: directory\n",
    "dotted.json": '{"storage": {"backend": "shm"}, "storage.backend": "shm"}',
    "dotted.yaml": "storage:\n  backend: shm\nstorage.backend: shm\n",
    "dotted.toml": '"storage.backend" = "shm"\n[storage]\nbackend = "shm"\n',
    "intkey.yaml": "1: 2\nplan:\n  page_size: 16\n",
    "intextra.yaml": "storage:\n  backend: dynamic\n  extra_config:\n    1: 2\n    allocator: shm\n",
    "pairs.yaml": "storage:\n  extra_config:\n    - [root, /a]\n",
    "seconds.json": '{"storage": {"tier": {"call_deadline_s": 1e308}}}',
    "digits.json": '{"storage": {"tier": {"call_deadline_s": ' + "9" * 29 + "}}}",
    "events.toml": "[runtime]\nevent_sets = -1\n",
    "deep.yaml": "plan:\n  pool_layouts: " + "[" * 5000 + "]" * 5000 + "\n",
}


@pytest.mark.parametrize("case", sorted(CONFIG_ENV_CASES))
def test_config_show_with_a_hostile_variable_is_one_line_exit_2(
    case: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in [v for v in os.environ if v.startswith("HICACHE_")]:
        monkeypatch.delenv(var)
    var, value = CONFIG_ENV_CASES[case]
    monkeypatch.setenv(var, value)
    check_usage_error(["config", "--show"], capsys)


@pytest.mark.parametrize("name", sorted(CONFIG_FILE_CASES))
def test_config_show_with_a_hostile_file_is_one_line_exit_2(
    name: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for var in [v for v in os.environ if v.startswith("HICACHE_")]:
        monkeypatch.delenv(var)
    path = tmp_path / name
    path.write_text(CONFIG_FILE_CASES[name])
    check_usage_error(["config", "--show", "--file", str(path)], capsys)


def test_an_empty_request_page_size_exits_at_once_end_to_end() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hicache", "bench", "cache", "--request-page-sizes", "1,,16"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1
    assert "'1,,16'" in done.stderr
