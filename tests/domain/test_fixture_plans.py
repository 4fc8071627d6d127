"""Plans of every bundled HuggingFace config, checked against byte counts worked out by hand
(tests/domain/fixture_expectations.py holds the expected documents and their derivation)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.domain import ConfigError, ModelSpec, PlanSettings, plan_stack
from tests.domain.fixture_expectations import (
    EXPECTED,
    NEMO_ATTN,
    actual_document,
    expected_document,
)


@pytest.mark.parametrize(("name", "tp"), sorted(EXPECTED))
def test_fixture_plan(fixtures_dir: Path, name: str, tp: int) -> None:
    config = json.loads((fixtures_dir / f"{name}.json").read_text())
    plan = plan_stack(ModelSpec.from_hf_config(config), PlanSettings(tp_size=tp))
    doc = plan.as_json()
    assert actual_document(doc) == expected_document(name, tp)
    for p in doc["pools"]:
        assert p["bytes"] == p["bytes_per_unit_per_layer"] * p["layers"] * p["capacity"]
        assert p["host_memory"] == doc["host_memory"]
        assert p["layout"] == "page_first_direct"


def test_qwen3_next_full_attention_transfer_layers(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "qwen3-next-80b-a3b-instruct.json").read_text())
    plan = plan_stack(ModelSpec.from_hf_config(config))
    kv = plan.pool("kv").binding
    assert kv.as_dict() == {
        3: 0,
        7: 1,
        11: 2,
        15: 3,
        19: 4,
        23: 5,
        27: 6,
        31: 7,
        35: 8,
        39: 9,
        43: 10,
        47: 11,
    }
    assert plan.transfer_layers == 48
    assert plan.model_layers == tuple(range(48))


def test_nemotron_model_layers_map_transfer_layers_back(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "nemotron-h-8b-base-8k.json").read_text())
    plan = plan_stack(ModelSpec.from_hf_config(config))
    assert plan.model_layers is not None
    # attention transfer layers 4, 10, 16, 22 are model layers 7, 18, 29, 40
    assert [plan.model_layers[t] for t in NEMO_ATTN] == [7, 18, 29, 40]
    assert all(config["hybrid_override_pattern"][m] != "-" for m in plan.model_layers)


@pytest.mark.parametrize(
    ("name", "tp", "message"),
    [
        ("qwen3-next-80b-a3b-instruct", 32, "linear-attention key: 16 heads cannot be split"),
        ("nemotron-h-8b-base-8k", 256, "Mamba: 128 heads cannot be split over tp=256"),
        ("llama-3.1-8b-instruct", 3, "8 heads can be neither split over nor replicated"),
        ("gpt-oss-20b", 3, "8 heads can be neither split over nor replicated"),
    ],
)
def test_tp_sizes_a_fixture_does_not_allow(
    fixtures_dir: Path, name: str, tp: int, message: str
) -> None:
    config = json.loads((fixtures_dir / f"{name}.json").read_text())
    with pytest.raises(ConfigError, match=message):
        plan_stack(ModelSpec.from_hf_config(config), PlanSettings(tp_size=tp))
