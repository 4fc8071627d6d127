"""HuggingFace config readers: a config.json dict into a ModelSpec.

- read_hf_config: unwrap ``text_config``, pick the reader by model_type, wrap bad values in
  ConfigError; a ``layer_types`` list that the reader does not use must agree with it.

Every field is read strictly and bounded (reader_fields.py): an integer is an int, never a bool,
float or numeric string, and at least 1 (0 is refused, not taken as "unset").
- SUPPORTED_MODEL_TYPES: the model types with a reader.

Where each number comes from, per model type, is tabled in docs/models.md.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError, UnsupportedModelError
from hicache.domain.limits import MAX_UNITS, config_flag, config_int
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
    install_hf_reader,
    layer_subset,
)
from hicache.domain.reader_fields import (
    _attention,
    _check_layer_types,
    _dtype,
    _head_dim,
    _ids,
    _int,
    _layer_types,
    _layers,
    _opt,
    _window,
    unwrap_text_config,
)


def _dense(config: Mapping[str, Any]) -> ModelSpec:
    n = _layers(config)
    kinds = _layer_types(config, n)
    window = None  # read only when a sliding layer uses it (dense configs carry stale values)
    if kinds is None:
        kinds = (LayerKind.FULL_ATTENTION,) * n
    elif LayerKind.SLIDING_ATTENTION in kinds:
        window = _window(config, "sliding_window")
        if window is None:
            raise ConfigError("layer_types names sliding layers but sliding_window is not set")
    # Other layer_types (linear attention) are honoured: ModelSpec refuses them without a state.
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
    n = _layers(config)
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


def _every_nth_full(n: int, interval: int, other: LayerKind) -> tuple[LayerKind, ...]:
    """Layers 1..n where every ``interval``-th is full attention and the rest are ``other``."""
    return tuple(LayerKind.FULL_ATTENTION if (i + 1) % interval == 0 else other for i in range(n))


def _sliding(config: Mapping[str, Any]) -> ModelSpec:
    n = _layers(config)
    kinds = _layer_types(config, n)
    if kinds is None:
        pattern = _opt(config, "sliding_window_pattern", "_sliding_window_pattern")
        if pattern is None:
            raise ConfigError(
                f"{config['model_type']} config needs layer_types or sliding_window_pattern"
            )
        kinds = _every_nth_full(n, pattern, LayerKind.SLIDING_ATTENTION)
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=_attention(config),
        sliding_window=config_int(config, "sliding_window", maximum=MAX_UNITS),
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
    n = _layers(config)
    kinds = _layer_types(config, n)
    if kinds is None:
        interval = _int(config, "full_attention_interval")
        kinds = _every_nth_full(n, interval, LayerKind.LINEAR_ATTENTION)
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
    n = _layers(config)
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
    head_dim = _opt(config, "attention_head_dim", "head_dim") or _head_dim(config)
    heads = _opt(config, "mamba_num_heads")
    head = _opt(config, "mamba_head_dim")
    if heads is None or head is None:
        expand = _int(config, "expand")
        head = head or 64  # transformers' NemotronHConfig default mamba_head_dim
        heads = expand * _int(config, "hidden_size") // head
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=tuple(table[c] for c in pattern),
        attention=AttentionSpec(
            kv_heads=_opt(config, "num_key_value_heads") or _int(config, "num_attention_heads"),
            head_dim=head_dim,
        ),
        state=Mamba2Spec(
            heads=heads,
            head_dim=head,
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
    n = _layers(config)
    sparse = config.get("sparse_attention_config")
    if sparse is None:
        sparse = {}
    if not isinstance(sparse, Mapping):
        raise ConfigError(f"sparse_attention_config must be a mapping, got {sparse!r}")
    dtype = _dtype(config)
    indexer = None
    indexer_layers = None
    if config_flag(sparse, "use_sparse_attention"):
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
    n = _layers(config)
    local_raw = config.get("local_layer_ids")
    local = [] if local_raw is None else _ids(local_raw, "local_layer_ids", 0, n - 1)
    hd = _head_dim(config)
    kv = _int(config, "num_key_value_heads")
    swa_kv = _opt(config, "swa_num_key_value_heads") or kv
    swa_hd = _opt(config, "swa_head_dim") or hd
    local_set = set(local)
    kinds = tuple(
        LayerKind.SLIDING_ATTENTION if i in local_set else LayerKind.FULL_ATTENTION
        for i in range(n)
    )
    has_local = bool(local_set)
    state = None
    state_layers = None
    if config_flag(config, "use_sconv"):
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
        attention=AttentionSpec(kv_heads=kv, head_dim=hd, v_head_dim=_opt(config, "v_head_dim")),
        sliding_window=config_int(config, "sliding_window_size", maximum=MAX_UNITS)
        if has_local
        else None,
        sliding_attention=AttentionSpec(
            kv_heads=swa_kv, head_dim=swa_hd, v_head_dim=_opt(config, "swa_v_head_dim")
        )
        if has_local
        else None,
        state=state,
        state_layers=state_layers,
        dtype=_dtype(config),
    )


def _kimi_linear(config: Mapping[str, Any]) -> ModelSpec:
    n = _layers(config)
    lin = config.get("linear_attn_config")
    if not isinstance(lin, Mapping):
        raise ConfigError(f"kimi_linear needs a linear_attn_config mapping, got {lin!r}")
    # Layer ids in kda_layers are 1-based (SGLang configs/kimi_linear.py is_kda_layer).
    kda = _ids(lin["kda_layers"], f"linear_attn_config.kda_layers (1-based ids in [1, {n}])", 1, n)
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


def _mamba_head(config: Mapping[str, Any], intermediate: int, heads: int) -> int:
    """mamba_d_head, or intermediate // heads when it is absent or "auto"."""
    if config.get("mamba_d_head", "auto") in (None, "auto"):
        if intermediate % heads:
            raise ConfigError(
                f"mamba intermediate size {intermediate} is not divisible by mamba_n_heads {heads}"
            )
        return intermediate // heads
    return _int(config, "mamba_d_head")


def _mamba_state(
    config: Mapping[str, Any], heads: int, head: int, intermediate: int | None = None
) -> Mamba2Spec:
    """The Mamba2 mixer from the ``mamba_``-prefixed fields (Falcon-H1, GraniteMoeHybrid)."""
    return Mamba2Spec(
        heads=heads,
        head_dim=head,
        state_size=_int(config, "mamba_d_state"),
        n_groups=_int(config, "mamba_n_groups"),
        conv_kernel=_int(config, "mamba_d_conv"),
        intermediate=intermediate,
    )


def _falcon_h1(config: Mapping[str, Any]) -> ModelSpec:
    n = _layers(config)
    hidden = _int(config, "hidden_size")
    heads = _int(config, "mamba_n_heads")
    d_ssm = _opt(config, "mamba_d_ssm")
    intermediate = d_ssm if d_ssm is not None else (_opt(config, "mamba_expand") or 2) * hidden
    head = _mamba_head(config, intermediate, heads)
    # Attention and Mamba2 side by side in every layer (SGLang configs/falcon_h1.py).
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=(LayerKind.FULL_ATTENTION,) * n,
        attention=_attention(config),
        state=_mamba_state(config, heads, head, intermediate),
        state_layers=tuple(range(n)),
        dtype=_dtype(config),
    )


def _granite_hybrid(config: Mapping[str, Any]) -> ModelSpec:
    n = _layers(config)
    types = config["layer_types"]
    table = {"mamba": LayerKind.MAMBA, "attention": LayerKind.FULL_ATTENTION}
    if not isinstance(types, list) or len(types) < n or any(t not in table for t in types[:n]):
        raise ConfigError(f"layer_types must list {n} of 'mamba'/'attention', got {types!r}")
    hidden = _int(config, "hidden_size")
    heads = _int(config, "mamba_n_heads")
    intermediate = (_opt(config, "mamba_expand") or 2) * hidden
    head = _mamba_head(config, intermediate, heads)
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=tuple(table[t] for t in types[:n]),
        attention=_attention(config),
        state=_mamba_state(config, heads, head),
        dtype=_dtype(config),
    )


def _mimo_v2(config: Mapping[str, Any]) -> ModelSpec:
    n = _layers(config)
    pattern = layer_subset(config["hybrid_layer_pattern"], n, "hybrid_layer_pattern")
    swa = set(pattern)  # 1 = sliding window, 0 = full attention
    kinds = tuple(
        LayerKind.SLIDING_ATTENTION if i in swa else LayerKind.FULL_ATTENTION for i in range(n)
    )
    hd = _head_dim(config)
    window = _window(config, "sliding_window", "sliding_window_size")
    if swa and window is None:
        raise ConfigError("hybrid_layer_pattern names sliding layers but sliding_window is not set")
    return ModelSpec(
        model_type=str(config["model_type"]),
        layer_kinds=kinds,
        attention=AttentionSpec(
            kv_heads=_int(config, "num_key_value_heads"),
            head_dim=hd,
            v_head_dim=_opt(config, "v_head_dim"),
        ),
        sliding_window=window if swa else None,
        sliding_attention=AttentionSpec(
            kv_heads=_int(config, "swa_num_key_value_heads"),
            head_dim=_opt(config, "swa_head_dim") or hd,
            v_head_dim=_opt(config, "swa_v_head_dim"),
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

# Readers that derive layer kinds from layer_types themselves; every other reader derives them
# from its own keys, and a layer_types list in such a config must then agree (_check_layer_types).
_READS_LAYER_TYPES = frozenset({_dense, _sliding, _gemma3, _qwen3_next, _qwen3_next_like})


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
        text = unwrap_text_config(config)
        spec = reader(text)
        if reader not in _READS_LAYER_TYPES and reader is not _granite_hybrid:
            _check_layer_types(spec, text)
        return spec
    except KeyError as e:
        raise ConfigError(f"{model_type} config is missing key {e.args[0]!r}") from None
    except (TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{model_type} config has a malformed value: {e}") from None


install_hf_reader(read_hf_config)
