"""The allocator story as a regression test.

The reference engine resolved backend "dynamic" + '{"allocator": "shm"}' to shared memory for its
main KV pool but built the Mamba pool and the indexer pool with the raw name "dynamic", so they
fell back to anonymous memory. In hicache every pool of a group takes the one resolved kind,
whatever form the extra config arrives in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hicache.bootstrap import load_extra_config, storage_settings
from hicache.domain import (
    AttentionSpec,
    ConfigError,
    DType,
    GatedDeltaNetSpec,
    HostGroupPlan,
    IndexerSpec,
    LayerKind,
    ModelSpec,
    PlanSettings,
    StorageSettings,
    plan_stack,
    resolve_host_memory,
)

FULL, SLIDING = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION
LINEAR, MAMBA = LayerKind.LINEAR_ATTENTION, LayerKind.MAMBA

# KV + SWA + Mamba-style recurrent state (the hybrid stack whose state pool fell back).
KV_SWA_STATE = ModelSpec(
    model_type="kv_swa_state",
    layer_kinds=[LINEAR, SLIDING, LINEAR, FULL] * 3,
    attention=AttentionSpec(kv_heads=4, head_dim=128),
    sliding_window=1024,
    state=GatedDeltaNetSpec(key_heads=4, value_heads=8, key_dim=64, value_dim=64, conv_kernel=4),
)
# MHA + K-only indexer (the sparse-attention stack whose indexer pool fell back).
MHA_INDEXER = ModelSpec(
    model_type="mha_indexer",
    layer_kinds=[FULL] * 6,
    attention=AttentionSpec(kv_heads=8, head_dim=128),
    indexer=IndexerSpec(heads=4, head_dim=128, dtype=DType.BF16),
)

EXTRA_FILES: dict[str, str] = {
    "extra.toml": 'allocator = "shm"\n[client]\nretries = 3\n',
    "extra.yaml": "allocator: shm\nclient:\n  retries: 3\n",
    "extra.yml": "allocator: shm\nclient:\n  retries: 3\n",
    "extra.json": '{"allocator": "shm", "client": {"retries": 3}}',
}


def kinds(plan: HostGroupPlan) -> dict[str, str]:
    return {p["name"]: p["host_memory"]["kind"] for p in plan.as_json()["pools"]}


def plan_with(spec: ModelSpec, storage: StorageSettings) -> HostGroupPlan:
    return plan_stack(spec, PlanSettings(page_size=16, device_tokens=1024, storage=storage))


@pytest.mark.parametrize(
    ("spec", "pools"),
    [(KV_SWA_STATE, {"kv", "swa", "mamba"}), (MHA_INDEXER, {"kv", "indexer"})],
)
def test_dynamic_shm_gives_shm_to_every_pool(spec: ModelSpec, pools: set[str]) -> None:
    plan = plan_with(spec, StorageSettings("dynamic", '{"allocator": "shm"}'))
    assert kinds(plan) == dict.fromkeys(pools, "shm")
    assert plan.host_memory.kind.name == "shm"


@pytest.mark.parametrize("filename", sorted(EXTRA_FILES))
@pytest.mark.parametrize("spec", [KV_SWA_STATE, MHA_INDEXER], ids=["kv_swa_state", "mha_indexer"])
def test_dynamic_shm_from_a_file_gives_shm_to_every_pool(
    spec: ModelSpec, filename: str, tmp_path: Path
) -> None:
    path = tmp_path / filename
    path.write_text(EXTRA_FILES[filename])
    storage = storage_settings("dynamic", f"@{path}")
    assert storage.extra_config == {"allocator": "shm", "client": {"retries": 3}}
    assert set(kinds(plan_with(spec, storage)).values()) == {"shm"}


def test_every_form_of_the_extra_config_resolves_the_same(tmp_path: Path) -> None:
    (tmp_path / "extra.toml").write_text(EXTRA_FILES["extra.toml"])
    forms: list[object] = [
        '{"allocator": "shm", "client": {"retries": 3}}',
        {"allocator": "shm", "client": {"retries": 3}},
        f"@{tmp_path / 'extra.toml'}",
    ]
    first, *others = [storage_settings("dynamic", f) for f in forms]  # type: ignore[arg-type]
    assert all(o == first for o in others)
    assert {resolve_host_memory(s).kind.name for s in (first, *others)} == {"shm"}


def test_the_domain_never_reads_a_file() -> None:
    with pytest.raises(ConfigError, match=r"read it with hicache\.bootstrap\.load_extra_config"):
        StorageSettings("dynamic", "@extra.toml")


def test_no_backend_and_empty_backend_are_anonymous() -> None:
    assert storage_settings(None).backend is None
    assert storage_settings("").backend is None
    assert set(kinds(plan_with(MHA_INDEXER, storage_settings(None))).values()) == {"anonymous"}


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.with_suffix(".toml").write_text("allocator = "), "cannot parse extra config"),
        (lambda p: p.with_suffix(".yaml").write_text("a: [1"), "cannot parse extra config"),
        (lambda p: p.with_suffix(".json").write_text("{"), "cannot parse extra config"),
        (lambda p: p.with_suffix(".json").write_text("[1, 2]"), "must hold a mapping, got list"),
        (lambda p: p.with_suffix(".ini").write_text("x=1"), "has suffix '.ini': expected .json"),
        (lambda p: p.with_suffix(".json").write_bytes(b"\xff\xfe\x00"), "not UTF-8 text"),
    ],
    ids=["toml", "yaml", "json", "not-a-mapping", "suffix", "binary"],
)
def test_bad_extra_config_files_are_config_errors_naming_the_file(
    tmp_path: Path, write: Callable[[Path], object], message: str
) -> None:
    base = tmp_path / "extra"
    write(base)
    path = next(tmp_path.iterdir())
    with pytest.raises(ConfigError, match=message) as info:
        load_extra_config(f"@{path}")
    assert str(path) in str(info.value)


def test_an_unreadable_extra_config_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=f"cannot read extra config file '{missing}'"):
        load_extra_config(f"@{missing}")
    with pytest.raises(ConfigError, match="cannot read extra config file"):
        load_extra_config(f"@{tmp_path}")  # a directory


def test_an_unknown_allocator_in_a_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "extra.toml"
    path.write_text('allocator = "hugepages"\n')
    with pytest.raises(ConfigError, match="unknown allocator 'hugepages'"):
        plan_with(MHA_INDEXER, storage_settings("dynamic", f"@{path}"))
