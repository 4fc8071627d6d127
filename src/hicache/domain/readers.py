"""HuggingFace config readers: a config.json dict into a ModelSpec.

- read_hf_config: unwrap ``text_config``, pick the reader by model_type, wrap bad values in
  ConfigError.
- SUPPORTED_MODEL_TYPES: the model types with a reader.

Where each number comes from, per model type, is tabled in docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError, UnsupportedModelError
from hicache.domain.models import (
    AttentionSpec,
    GatedDeltaNetSpec,
    IndexerSpec,
    KimiDeltaSpec,
    LayerKind,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    ShortConvSpec,
    layer_subset,
)


def unwrap_text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` merged over nothing, keeping the outer
    model_type (what the user named) and the outer dtype when the text config has none."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return dict(config)
    merged = dict(text)
    merged["model_type"] = config.get("model_type")
    merged["text_model_type"] = text.get("model_type")
    for key in ("torch_dtype", "dtype"):
        if key in config and "torch_dtype" not in text and "dtype" not in text:
            merged[key] = config[key]
    return merged


def _int(config: Mapping[str, Any], key: str) -> int:
    value = config[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    return value


def _dtype(config: Mapping[str, Any]) -> DType:
    value = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    return DType.parse(str(value))


def _head_dim(config: Mapping[str, Any]) -> int:
    hd = config.get("head_dim")
    if isinstance(hd, int) and hd > 0:
        return hd
    heads = _int(config, "num_attention_heads")
    hidden = _int(config, "hidden_size")
    if hidden % heads:
        raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def _attention(config: Mapping[str, Any]) -> AttentionSpec:
    kv = config.get("num_key_value_heads") or _int(config, "num_attention_heads")
    return AttentionSpec(kv_heads=int(kv), head_dim=_head_dim(config))


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
        if t not in table:
            raise ConfigError(f"unknown layer type {t!r} in layer_types: expected {sorted(table)}")
        out.append(table[t])
    return tuple(out)


def _dense(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    kinds = _layer_types(config, n)
    window = config.get("sliding_window")
    if kinds is not None and LayerKind.SLIDING_ATTENTION in kinds:
        if not isinstance(window, int):
            raise ConfigError("layer_types names sliding layers but sliding_window is not set")
    else:
        kinds = (LayerKind.FULL_ATTENTION,) * n
        window = None
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=_attention(config),
        sliding_window=window,
        dtype=_dtype(config),
    )


def _mla(config: Mapping[str, Any]) -> MLASpec:
    return MLASpec(
        kv_lora_rank=_int(config, "kv_lora_rank"), qk_rope_head_dim=_int(config, "qk_rope_head_dim")
    )


def _deepseek(config: Mapping[str, Any]) -> ModelSpec:
    # MTP / next-n layers sit after num_hidden_layers and get no pool layer.
    n = _int(config, "num_hidden_layers")
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=(LayerKind.FULL_ATTENTION,) * n,
        attention=_mla(config),
        dtype=_dtype(config),
    )


def _deepseek_v32(config: Mapping[str, Any]) -> ModelSpec:
    base = _deepseek(config)
    # The lightning indexer keeps one fp8 K head of index_head_dim with a float32 scale per 128.
    indexer = IndexerSpec(
        heads=1,
        head_dim=_int(config, "index_head_dim"),
        dtype=DType.FP8_E4M3,
        scale_block=128,
    )
    return attrs.evolve(base, indexer=indexer)


def _sliding(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    kinds = _layer_types(config, n)
    if kinds is None:
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
        if not isinstance(pattern, int) or pattern <= 0:
            raise ConfigError(
                f"{config['model_type']} config needs layer_types or sliding_window_pattern"
            )
        kinds = tuple(
            LayerKind.FULL_ATTENTION if (i + 1) % pattern == 0 else LayerKind.SLIDING_ATTENTION
            for i in range(n)
        )
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=_attention(config),
        sliding_window=_int(config, "sliding_window"),
        dtype=_dtype(config),
    )


# transformers' Gemma3TextConfig defaults: HuggingFace checkpoints omit keys equal to them (the
# text_config of gemma-3-12b-it names neither head_dim nor layer_types nor a sliding pattern), so a
# reader without them fails or, worse, derives head_dim = hidden_size / heads (240, not 256).
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "sliding_window": 4096,
}
_GEMMA3_SLIDING_PATTERN = 6


def _gemma3(config: Mapping[str, Any]) -> ModelSpec:
    text = config.get("text_config")
    source: Mapping[str, Any] = text if isinstance(text, Mapping) else config
    merged = {**_GEMMA3_TEXT_DEFAULTS, **source, "model_type": config["model_type"]}
    for key in ("torch_dtype", "dtype"):
        if key in config and key not in source:
            merged[key] = config[key]
    if not any(
        k in source for k in ("layer_types", "sliding_window_pattern", "_sliding_window_pattern")
    ):
        merged["sliding_window_pattern"] = _GEMMA3_SLIDING_PATTERN
    return _sliding(merged)


def _qwen3_next(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    kinds = _layer_types(config, n)
    if kinds is None:
        interval = _int(config, "full_attention_interval")
        kinds = tuple(
            LayerKind.FULL_ATTENTION if (i + 1) % interval == 0 else LayerKind.LINEAR_ATTENTION
            for i in range(n)
        )
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=_attention(config),
        state=GatedDeltaNetSpec(
            key_heads=_int(config, "linear_num_key_heads"),
            value_heads=_int(config, "linear_num_value_heads"),
            key_dim=_int(config, "linear_key_head_dim"),
            value_dim=_int(config, "linear_value_head_dim"),
            conv_kernel=_int(config, "linear_conv_kernel_dim"),
        ),
        dtype=_dtype(config),
    )


def _nemotron_h(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    pattern = config["hybrid_override_pattern"]
    if not isinstance(pattern, str) or len(pattern) != n:
        raise ConfigError(
            f"hybrid_override_pattern must be a string of {n} characters, got {pattern!r}"
        )
    table = {
        "M": LayerKind.MAMBA,
        "*": LayerKind.FULL_ATTENTION,
        "-": LayerKind.NONE,
        "E": LayerKind.NONE,
    }
    bad = sorted({c for c in pattern if c not in table})
    if bad:
        raise ConfigError(
            f"hybrid_override_pattern has unknown layer symbols {bad}: expected M * - E"
        )
    head_dim = config.get("attention_head_dim") or config.get("head_dim") or _head_dim(config)
    heads = config.get("mamba_num_heads")
    head = config.get("mamba_head_dim")
    if heads is None or head is None:
        expand = _int(config, "expand")
        head = int(head or 64)
        heads = expand * _int(config, "hidden_size") // head
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=tuple(table[c] for c in pattern),
        attention=AttentionSpec(
            kv_heads=int(config.get("num_key_value_heads") or _int(config, "num_attention_heads")),
            head_dim=int(head_dim),
        ),
        state=Mamba2Spec(
            heads=int(heads),
            head_dim=int(head),
            state_size=_int(config, "ssm_state_size"),
            n_groups=_int(config, "n_groups"),
            conv_kernel=_int(config, "conv_kernel"),
        ),
        dtype=_dtype(config),
    )


def _qwen3_next_like(config: Mapping[str, Any]) -> ModelSpec:
    # Qwen3.5 and Qwen3.5-MoE keep Qwen3-Next's Gated DeltaNet fields (SGLang configs/qwen3_5.py).
    return _qwen3_next(config)


def _minimax_m3(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    sparse = config.get("sparse_attention_config") or {}
    if not isinstance(sparse, Mapping):
        raise ConfigError(f"sparse_attention_config must be a mapping, got {sparse!r}")
    dtype = _dtype(config)
    indexer = None
    indexer_layers = None
    if sparse.get("use_sparse_attention"):
        indexer_layers = layer_subset(
            sparse["sparse_attention_freq"], n, "sparse_attention_config.sparse_attention_freq"
        )
        # One plain K head, replicated on every rank, in the model's dtype even with an fp8 KV.
        indexer = IndexerSpec(heads=1, head_dim=_int(sparse, "sparse_index_dim"), dtype=dtype)
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=(LayerKind.FULL_ATTENTION,) * n,
        attention=_attention(config),
        indexer=indexer,
        indexer_layers=indexer_layers,
        dtype=dtype,
    )


def _inkling(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    local = config.get("local_layer_ids") or []
    if not isinstance(local, list) or any(not isinstance(i, int) or not 0 <= i < n for i in local):
        raise ConfigError(f"local_layer_ids must list layer ids below {n}, got {local!r}")
    hd = _head_dim(config)
    kv = _int(config, "num_key_value_heads")
    swa_kv = int(config.get("swa_num_key_value_heads") or kv)
    swa_hd = int(config.get("swa_head_dim") or hd)
    local_set = set(local)
    kinds = tuple(
        LayerKind.SLIDING_ATTENTION if i in local_set else LayerKind.FULL_ATTENTION
        for i in range(n)
    )
    has_local = bool(local_set)
    state = None
    state_layers = None
    if config.get("use_sconv"):
        state = ShortConvSpec(
            kv_heads=kv,
            head_dim=hd,
            swa_kv_heads=swa_kv,
            swa_head_dim=swa_hd,
            hidden_size=_int(config, "hidden_size"),
            conv_kernel=_int(config, "sconv_kernel_size"),
        )
        state_layers = tuple(range(n))
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=AttentionSpec(kv_heads=kv, head_dim=hd, v_head_dim=config.get("v_head_dim")),
        sliding_window=_int(config, "sliding_window_size") if has_local else None,
        sliding_attention=AttentionSpec(
            kv_heads=swa_kv, head_dim=swa_hd, v_head_dim=config.get("swa_v_head_dim")
        )
        if has_local
        else None,
        state=state,
        state_layers=state_layers,
        dtype=_dtype(config),
    )


def _kimi_linear(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    lin = config.get("linear_attn_config")
    if not isinstance(lin, Mapping):
        raise ConfigError(f"kimi_linear needs a linear_attn_config mapping, got {lin!r}")
    kda = lin["kda_layers"]
    # Layer ids in kda_layers are 1-based (SGLang configs/kimi_linear.py is_kda_layer).
    if not isinstance(kda, list) or any(not isinstance(i, int) or not 1 <= i <= n for i in kda):
        raise ConfigError(
            f"linear_attn_config.kda_layers must list 1-based ids in [1, {n}], got {kda!r}"
        )
    kda_set = {i - 1 for i in kda}
    kinds = tuple(
        LayerKind.LINEAR_ATTENTION if i in kda_set else LayerKind.FULL_ATTENTION for i in range(n)
    )
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=_mla(config),
        state=KimiDeltaSpec(
            heads=_int(lin, "num_heads"),
            head_dim=_int(lin, "head_dim"),
            conv_kernel=_int(lin, "short_conv_kernel_size"),
        ),
        dtype=_dtype(config),
    )


def _falcon_h1(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    hidden = _int(config, "hidden_size")
    heads = _int(config, "mamba_n_heads")
    d_ssm = config.get("mamba_d_ssm")
    intermediate = int(d_ssm) if d_ssm is not None else int(config.get("mamba_expand", 2)) * hidden
    d_head = config.get("mamba_d_head", "auto")
    head = intermediate // heads if d_head in (None, "auto") else int(d_head)
    # Attention and Mamba2 side by side in every layer (SGLang configs/falcon_h1.py).
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=(LayerKind.FULL_ATTENTION,) * n,
        attention=_attention(config),
        state=Mamba2Spec(
            heads=heads,
            head_dim=head,
            state_size=_int(config, "mamba_d_state"),
            n_groups=_int(config, "mamba_n_groups"),
            conv_kernel=_int(config, "mamba_d_conv"),
            intermediate=intermediate,
        ),
        state_layers=tuple(range(n)),
        dtype=_dtype(config),
    )


def _granite_hybrid(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    types = config["layer_types"]
    table = {"mamba": LayerKind.MAMBA, "attention": LayerKind.FULL_ATTENTION}
    if not isinstance(types, list) or len(types) < n or any(t not in table for t in types[:n]):
        raise ConfigError(f"layer_types must list {n} of 'mamba'/'attention', got {types!r}")
    hidden = _int(config, "hidden_size")
    heads = _int(config, "mamba_n_heads")
    intermediate = int(config.get("mamba_expand", 2)) * hidden
    d_head = config.get("mamba_d_head")
    head = intermediate // heads if d_head in (None, "auto") else int(d_head)
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=tuple(table[t] for t in types[:n]),
        attention=_attention(config),
        state=Mamba2Spec(
            heads=heads,
            head_dim=head,
            state_size=_int(config, "mamba_d_state"),
            n_groups=_int(config, "mamba_n_groups"),
            conv_kernel=_int(config, "mamba_d_conv"),
        ),
        dtype=_dtype(config),
    )


def _mimo_v2(config: Mapping[str, Any]) -> ModelSpec:
    n = _int(config, "num_hidden_layers")
    pattern = layer_subset(config["hybrid_layer_pattern"], n, "hybrid_layer_pattern")
    swa = set(pattern)  # 1 = sliding window, 0 = full attention
    kinds = tuple(
        LayerKind.SLIDING_ATTENTION if i in swa else LayerKind.FULL_ATTENTION for i in range(n)
    )
    hd = _head_dim(config)
    window = config.get("sliding_window") or config.get("sliding_window_size")
    if swa and not isinstance(window, int):
        raise ConfigError("hybrid_layer_pattern names sliding layers but sliding_window is not set")
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=AttentionSpec(
            kv_heads=_int(config, "num_key_value_heads"),
            head_dim=hd,
            v_head_dim=config.get("v_head_dim"),
        ),
        sliding_window=window if swa else None,
        sliding_attention=AttentionSpec(
            kv_heads=_int(config, "swa_num_key_value_heads"),
            head_dim=int(config.get("swa_head_dim") or hd),
            v_head_dim=config.get("swa_v_head_dim"),
        )
        if swa
        else None,
        dtype=_dtype(config),
    )


def _glm_dsa(config: Mapping[str, Any]) -> ModelSpec:
    spec = _deepseek_v32(config)
    types = config.get("indexer_types")
    if types is None:
        return spec
    n = spec.num_layers
    if (
        not isinstance(types, list)
        or len(types) < n
        or any(t not in ("full", "shared") for t in types[:n])
    ):
        raise ConfigError(f"indexer_types must list {n} of 'full'/'shared', got {types!r}")
    # A "shared" layer reuses another layer's indexer output and keeps no indexer cache.
    return attrs.evolve(spec, indexer_layers=[i for i, t in enumerate(types[:n]) if t == "full"])


_READERS: dict[str, Callable[[Mapping[str, Any]], ModelSpec]] = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    "qwen3_moe": _dense,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek_v32,
    "glm_moe_dsa": _glm_dsa,
    "gpt_oss": _sliding,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_next_like,
    "qwen3_5_text": _qwen3_next_like,
    "qwen3_5_moe": _qwen3_next_like,
    "qwen3_5_moe_text": _qwen3_next_like,
    "nemotron_h": _nemotron_h,
    "minimax_m3_vl": _minimax_m3,
    "minimax_m3": _minimax_m3,
    "inkling_mm_model": _inkling,
    "inkling_model": _inkling,
    "inkling_text": _inkling,
    "kimi_linear": _kimi_linear,
    "falcon_h1": _falcon_h1,
    "granitemoehybrid": _granite_hybrid,
    "mimo_v2": _mimo_v2,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_READERS))


def read_hf_config(config: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from a HuggingFace config dict (its ``text_config`` when it has one)."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"a model config must be a mapping, got {type(config).__name__}")
    model_type = config.get("model_type")
    reader = _READERS.get(str(model_type))
    if reader is None:
        raise UnsupportedModelError(
            f"unsupported model type {model_type!r}: supported are "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    try:
        return reader(unwrap_text_config(config))
    except KeyError as e:
        raise ConfigError(f"{model_type} config is missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{model_type} config has a malformed value: {e}") from None
