"""Field readers shared by the HuggingFace config readers (readers.py): strict and bounded.

- unwrap_text_config: the language model's config out of a multimodal one.
- _int / _opt / _layers / _window / _ids: positive bounded integers (never a bool, float or
  numeric string; 0 is refused, not taken as "unset"), layer counts, windows, layer id lists.
- _dtype / _head_dim / _attention / _layer_types: dtype, head dim, MHA spec and layer_types.
- _check_layer_types: a layer_types list that a reader did not use must agree with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError
from hicache.domain.limits import (
    MAX_LAYERS,
    MAX_UNITS,
    bounded_int,
    config_int,
    optional_config_int,
)
from hicache.domain.models import AttentionSpec, LayerKind, ModelSpec


def unwrap_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` merged over nothing, keeping the outer
    model_type (what the user named) and the outer dtype when the text config has none."""
    text = config.get("text_config")
    if text is None:
        return dict(config)
    if not isinstance(text, Mapping):
        raise ConfigError(f"text_config must be a mapping, got {type(text).__name__}")
    merged = dict(text)
    merged["model_type"] = config.get("model_type")
    merged["text_model_type"] = text.get("model_type")
    for key in ("torch_dtype", "dtype"):
        if key in config and "torch_dtype" not in text and "dtype" not in text:
            merged[key] = config[key]
    return merged


def _int(config: Mapping[str, Any], key: str) -> int:
    """A positive integer (no bool, float or numeric string; 0 is refused, not defaulted).
    A missing key raises KeyError, which read_hf_config words with the model type."""
    if key not in config:
        raise KeyError(key)
    return config_int(config, key)


def _opt(config: Mapping[str, Any], *keys: str) -> int | None:
    """The first of ``keys`` that is present and not null, as a positive integer; else None."""
    for key in keys:
        value = optional_config_int(config, key)
        if value is not None:
            return value
    return None


def _layers(config: Mapping[str, Any]) -> int:
    if "num_hidden_layers" not in config:
        raise KeyError("num_hidden_layers")
    return config_int(config, "num_hidden_layers", maximum=MAX_LAYERS)


def _window(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = optional_config_int(config, key, maximum=MAX_UNITS)
        if value is not None:
            return value
    return None


def _ids(value: object, what: str, low: int, high: int) -> list[int]:
    """A list of layer ids in [low, high] (bools and floats refused)."""
    if not isinstance(value, list):
        raise ConfigError(f"{what} must be a list of layer ids, got {value!r}")
    return [bounded_int(i, f"{what} entry", minimum=low, maximum=high) for i in value]


def _dtype(config: Mapping[str, Any]) -> DType:
    value = config.get("torch_dtype")
    if value is None:
        value = config.get("dtype")
    if value is None:
        return DType.BF16
    if not isinstance(value, str):
        raise ConfigError(f"config key 'torch_dtype' must be a dtype name, got {value!r}")
    return DType.parse(value)


def _head_dim(config: Mapping[str, Any]) -> int:
    hd = _opt(config, "head_dim")
    if hd is not None:
        return hd
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    if hidden % heads:
        raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def _attention(config: Mapping[str, Any]) -> AttentionSpec:
    kv = _opt(config, "num_key_value_heads") or _int(config, "num_attention_heads")
    return AttentionSpec(kv_heads=kv, head_dim=_head_dim(config))


def _layer_types(config: Mapping[str, Any], n: int) -> tuple[LayerKind, ...] | None:
    types = config.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) < n:
        raise ConfigError(f"layer_types must list at least {n} layers, got {types!r}")
    table = {
        "full_attention": LayerKind.FULL_ATTENTION,
        "sliding_attention": LayerKind.SLIDING_ATTENTION,
        "linear_attention": LayerKind.LINEAR_ATTENTION,
    }
    out = []
    for t in types[:n]:
        if not isinstance(t, str):
            raise ConfigError(f"layer_types entries must be strings, got {t!r}")
        if t not in table:
            raise ConfigError(f"unknown layer type {t!r} in layer_types: expected {sorted(table)}")
        out.append(table[t])
    return tuple(out)


_LAYER_TYPE_NAMES = {
    "full_attention": LayerKind.FULL_ATTENTION,
    "attention": LayerKind.FULL_ATTENTION,
    "sliding_attention": LayerKind.SLIDING_ATTENTION,
    "linear_attention": LayerKind.LINEAR_ATTENTION,
    "mamba": LayerKind.MAMBA,
}


def _check_layer_types(spec: ModelSpec, config: Mapping[str, Any]) -> None:
    """A layer_types list the reader did not use must say what the reader derived, layer by
    layer; a config that contradicts itself is refused rather than half read."""
    types = config.get("layer_types")
    if types is None:
        return
    n = spec.num_layers
    if not isinstance(types, list) or len(types) < n:
        raise ConfigError(f"layer_types must list at least {n} layers, got {types!r}"[:300])
    for i, (name, kind) in enumerate(zip(types[:n], spec.layer_kinds, strict=True)):
        if not isinstance(name, str) or _LAYER_TYPE_NAMES.get(name) is not kind:
            raise ConfigError(
                f"{spec.model_type} config: layer_types[{i}] = {name!r} contradicts layer {i} "
                f"being {kind.value} as read from the model's other keys; hicache reads "
                f"{spec.model_type} layers from those keys, so remove or correct layer_types"
            )
