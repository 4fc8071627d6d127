"""Model configs are read strictly: the wrong plans of issue 12 are refused, each by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.domain import ConfigError, ModelSpec
from hicache.domain.limits import MAX_DEPTH, MAX_NODES, bounded_int, check_tree, parse_json

FIXTURES = Path(__file__).resolve().parents[2] / "src" / "hicache" / "fixtures" / "models"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


LLAMA = fixture("llama-3.1-8b-instruct")


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("num_key_value_heads", True, "'num_key_value_heads' must be an integer, got True"),
        ("num_key_value_heads", 8.9, "'num_key_value_heads' must be an integer, got 8.9"),
        ("num_key_value_heads", "8", "'num_key_value_heads' must be an integer, got '8'"),
        ("num_key_value_heads", 0, "'num_key_value_heads' must be at least 1, got 0"),
        ("num_key_value_heads", -8, "'num_key_value_heads' must be at least 1, got -8"),
        ("head_dim", 0, "'head_dim' must be at least 1, got 0"),
        ("head_dim", True, "'head_dim' must be an integer, got True"),
        ("num_hidden_layers", 10**9, "'num_hidden_layers' must be at most 65536"),
        ("num_hidden_layers", 10**40, "about 41 digits"),
        ("torch_dtype", 16, "'torch_dtype' must be a dtype name, got 16"),
    ],
)
def test_counts_are_ints_of_at_least_one_never_coerced_or_defaulted(
    key: str, value: object, words: str
) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        ModelSpec.from_hf_config({**LLAMA, key: value})


def test_zero_interval_and_zero_mamba_head_dim_are_refused_not_defaulted() -> None:
    with pytest.raises(ConfigError, match="'full_attention_interval' must be at least 1"):
        ModelSpec.from_hf_config(
            {**fixture("qwen3-next-80b-a3b-instruct"), "full_attention_interval": 0}
        )
    nemotron = fixture("nemotron-h-8b-base-8k")
    with pytest.raises(ConfigError, match="'mamba_head_dim' must be at least 1, got 0"):
        ModelSpec.from_hf_config({**nemotron, "mamba_head_dim": 0})


def test_flags_are_json_booleans() -> None:
    inkling = fixture("inkling")
    text = {**inkling["text_config"], "use_sconv": "false"}
    with pytest.raises(ConfigError, match="'use_sconv' must be true or false, got 'false'"):
        ModelSpec.from_hf_config({**inkling, "text_config": text})


def test_layer_types_a_reader_does_not_use_must_agree_with_it() -> None:
    deepseek = fixture("deepseek-v3")
    n = deepseek["num_hidden_layers"]
    agreeing = ModelSpec.from_hf_config({**deepseek, "layer_types": ["full_attention"] * n})
    assert agreeing == ModelSpec.from_hf_config(deepseek)
    with pytest.raises(ConfigError, match=r"layer_types\[0\] = 'sliding_attention' contradicts"):
        ModelSpec.from_hf_config({**deepseek, "layer_types": ["sliding_attention"] * n})


def test_dense_layer_types_are_honoured_not_replaced_by_full_attention() -> None:
    n = LLAMA["num_hidden_layers"]
    types = ["full_attention"] + ["linear_attention"] * (n - 1)
    with pytest.raises(ConfigError, match="linear-attention layers but no"):
        ModelSpec.from_hf_config({**LLAMA, "layer_types": types})


def test_a_text_config_that_is_not_a_mapping_is_refused() -> None:
    with pytest.raises(ConfigError, match="text_config must be a mapping, got list"):
        ModelSpec.from_hf_config({**LLAMA, "text_config": [1]})


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000, "nested too deeply"),
        ('{"x": Infinity}', "Infinity is not a number hicache accepts"),
        ('{"x": NaN}', "NaN is not a number"),
        ('{"x": 1e400}', "not a finite float"),
        ('{"x": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
        ('{"x": 99999999999999999999}', "beyond a 64-bit integer"),
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"at most {MAX_DEPTH} levels"),
    ],
)
def test_json_is_parsed_within_limits(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_json(text, "doc")


def test_a_document_of_shared_nodes_is_refused_before_it_is_walked_out() -> None:
    leaf: list[object] = ["x"] * 10
    for _ in range(8):  # 10^9 values through shared references, as a YAML alias bomb makes
        leaf = [leaf] * 10
    with pytest.raises(ConfigError, match=f"more than {MAX_NODES} values"):
        check_tree({"a": leaf}, "doc")


def test_bounded_int_names_the_limits() -> None:
    assert bounded_int(5, "x") == 5
    with pytest.raises(ConfigError, match="x must be at most 10, got 11"):
        bounded_int(11, "x", maximum=10)
    with pytest.raises(ConfigError, match="x must be an integer, got False"):
        bounded_int(False, "x")
