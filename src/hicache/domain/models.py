"""Model specs: which layers of a model keep which cache, read from a HuggingFace config.

- LayerKind: full attention, sliding attention, linear attention (Gated DeltaNet), Mamba2, none.
- AttentionSpec / MLASpec / IndexerSpec / Mamba2Spec / GatedDeltaNetSpec: per-model geometry.
- ModelSpec: the layer kinds plus the specs above; ModelSpec.from_hf_config(d) reads a config dict.
- ModelSpec.rank_geometries(tp, ...): per-rank pool geometries for a tensor-parallel size.
- stage_range: the [start, end) layer range of a pipeline stage.
- SUPPORTED_MODEL_TYPES: what from_hf_config accepts.

A spec can be built in Python for models without a public config (MiniMax-style MHA + K-only
indexer, Qwen3.5-style KV + SWA + Gated DeltaNet).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError, UnsupportedModelError
from hicache.domain.geometry import (
    IndexerGeometry,
    KVGeometry,
    MLAGeometry,
    StateGeometry,
    gated_deltanet_state,
    mamba2_state,
)
from hicache.domain.validators import optional_positive_int, positive_int


class LayerKind(enum.Enum):
    FULL_ATTENTION = "full_attention"
    SLIDING_ATTENTION = "sliding_attention"
    LINEAR_ATTENTION = "linear_attention"
    MAMBA = "mamba"
    NONE = "none"

    @property
    def has_cache(self) -> bool:
        return self is not LayerKind.NONE


def _kinds(value: object) -> tuple[LayerKind, ...]:
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"layer_kinds must be a sequence of LayerKind, got {value!r}")
    return tuple(value)


@attrs.frozen(kw_only=True)
class AttentionSpec:
    """MHA/GQA attention: total KV heads (before TP) and head dims."""

    kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    v_head_dim: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class MLASpec:
    """Multi-head latent attention: one replicated latent row per token."""

    kv_lora_rank: int = attrs.field(validator=positive_int)
    qk_rope_head_dim: int = attrs.field(validator=positive_int)
    row_width: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class IndexerSpec:
    """A K-only sparse-attention indexer on every full-attention layer.

    ``heads`` counts K heads (DeepSeek-V3.2 keeps one K head; its index_n_heads are query heads).
    ``dtype`` None means the KV dtype. ``scale_block`` set means fp8 with float32 block scales.
    """

    heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    dtype: DType | None = None
    scale_block: int | None = attrs.field(default=None, validator=optional_positive_int)


@attrs.frozen(kw_only=True)
class Mamba2Spec:
    heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    state_size: int = attrs.field(validator=positive_int)
    n_groups: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(validator=positive_int)


@attrs.frozen(kw_only=True)
class GatedDeltaNetSpec:
    key_heads: int = attrs.field(validator=positive_int)
    value_heads: int = attrs.field(validator=positive_int)
    key_dim: int = attrs.field(validator=positive_int)
    value_dim: int = attrs.field(validator=positive_int)
    conv_kernel: int = attrs.field(validator=positive_int)


StateSpec = Mamba2Spec | GatedDeltaNetSpec


@attrs.frozen(kw_only=True)
class RankGeometries:
    """Per-rank geometries of a model's pools (None where the model has no such pool)."""

    kv: KVGeometry | MLAGeometry | None
    swa: KVGeometry | None
    state: StateGeometry | None
    indexer: IndexerGeometry | None


def split_heads(heads: int, tp: int, what: str) -> int:
    """Heads per rank: split when tp divides them, replicated (1) when heads divide tp."""
    if heads % tp == 0:
        return heads // tp
    if tp % heads == 0:
        return 1
    raise ConfigError(
        f"{what}: {heads} heads can be neither split over nor replicated across tp={tp} ranks "
        f"(one of the two must divide the other)"
    )


def split_strict(heads: int, tp: int, what: str) -> int:
    if heads % tp:
        raise ConfigError(f"{what}: {heads} heads cannot be split over tp={tp} ranks")
    return heads // tp


@attrs.frozen(kw_only=True)
class ModelSpec:
    """What a model caches per layer. Build with from_hf_config or directly in Python."""

    model_type: str
    layer_kinds: tuple[LayerKind, ...] = attrs.field(converter=_kinds)
    attention: AttentionSpec | MLASpec | None = None
    sliding_window: int | None = attrs.field(default=None, validator=optional_positive_int)
    sliding_attention: AttentionSpec | None = None
    indexer: IndexerSpec | None = None
    state: StateSpec | None = None
    dtype: DType = DType.BF16

    def __attrs_post_init__(self) -> None:
        kinds = set(self.layer_kinds)
        if not self.layer_kinds:
            raise ConfigError(f"model {self.model_type!r} has no layers")
        attn_kinds = {LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION}
        if kinds & attn_kinds and self.attention is None:
            raise ConfigError(
                f"model {self.model_type!r} has attention layers but no attention spec"
            )
        if LayerKind.SLIDING_ATTENTION in kinds:
            if self.sliding_window is None:
                raise ConfigError(f"model {self.model_type!r} has sliding layers but no window")
            if isinstance(self.attention, MLASpec) and self.sliding_attention is None:
                raise ConfigError(
                    f"model {self.model_type!r}: sliding layers need an MHA spec "
                    f"(sliding_attention) when full attention is MLA"
                )
        state_kinds = {LayerKind.LINEAR_ATTENTION, LayerKind.MAMBA}
        used_state = kinds & state_kinds
        if len(used_state) > 1:
            raise ConfigError(f"model {self.model_type!r} mixes Mamba2 and linear-attention layers")
        if LayerKind.MAMBA in kinds and not isinstance(self.state, Mamba2Spec):
            raise ConfigError(f"model {self.model_type!r} has Mamba layers but no Mamba2Spec")
        if LayerKind.LINEAR_ATTENTION in kinds and not isinstance(self.state, GatedDeltaNetSpec):
            raise ConfigError(
                f"model {self.model_type!r} has linear-attention layers but no GatedDeltaNetSpec"
            )
        if self.indexer is not None and LayerKind.FULL_ATTENTION not in kinds:
            raise ConfigError(
                f"model {self.model_type!r} has an indexer but no full-attention layer"
            )
        if LayerKind.FULL_ATTENTION not in kinds:
            raise ConfigError(
                f"model {self.model_type!r} has no full-attention layer to anchor a host group"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def layers_of(self, kind: LayerKind, start: int = 0, end: int | None = None) -> tuple[int, ...]:
        stop = self.num_layers if end is None else end
        return tuple(i for i in range(start, stop) if self.layer_kinds[i] is kind)

    def rank_geometries(
        self,
        tp_size: int = 1,
        *,
        kv_dtype: DType | None = None,
        ssm_dtype: DType = DType.FP32,
        conv_dtype: DType | None = None,
    ) -> RankGeometries:
        """Per-rank geometries for ``tp_size`` tensor-parallel ranks."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
        kvd = kv_dtype or self.dtype
        kv: KVGeometry | MLAGeometry | None = None
        if isinstance(self.attention, MLASpec):
            kv = MLAGeometry(
                kv_lora_rank=self.attention.kv_lora_rank,
                qk_rope_head_dim=self.attention.qk_rope_head_dim,
                dtype=kvd,
                row_width=self.attention.row_width,
            )
        elif isinstance(self.attention, AttentionSpec):
            kv = KVGeometry(
                kv_heads=split_heads(self.attention.kv_heads, tp_size, f"{self.model_type} KV"),
                head_dim=self.attention.head_dim,
                v_head_dim=self.attention.v_head_dim,
                dtype=kvd,
            )
        swa: KVGeometry | None = None
        if LayerKind.SLIDING_ATTENTION in self.layer_kinds:
            sa = self.sliding_attention or self.attention
            if not isinstance(sa, AttentionSpec):  # pragma: no cover - checked in post_init
                raise ConfigError(f"model {self.model_type!r}: sliding layers need an MHA spec")
            swa = KVGeometry(
                kv_heads=split_heads(sa.kv_heads, tp_size, f"{self.model_type} sliding KV"),
                head_dim=sa.head_dim,
                v_head_dim=sa.v_head_dim,
                dtype=kvd,
            )
        state: StateGeometry | None = None
        cd = conv_dtype or self.dtype
        if isinstance(self.state, Mamba2Spec):
            s = self.state
            state = mamba2_state(
                heads=split_strict(s.heads, tp_size, f"{self.model_type} Mamba"),
                head_dim=s.head_dim,
                state_size=s.state_size,
                n_groups=split_heads(s.n_groups, tp_size, f"{self.model_type} Mamba groups"),
                conv_kernel=s.conv_kernel,
                conv_dtype=cd,
                ssm_dtype=ssm_dtype,
            )
        elif isinstance(self.state, GatedDeltaNetSpec):
            g = self.state
            state = gated_deltanet_state(
                key_heads=split_strict(
                    g.key_heads, tp_size, f"{self.model_type} linear-attention key"
                ),
                value_heads=split_strict(
                    g.value_heads, tp_size, f"{self.model_type} linear-attention value"
                ),
                key_dim=g.key_dim,
                value_dim=g.value_dim,
                conv_kernel=g.conv_kernel,
                conv_dtype=cd,
                ssm_dtype=ssm_dtype,
            )
        indexer: IndexerGeometry | None = None
        if self.indexer is not None:
            ix = self.indexer
            indexer = IndexerGeometry(
                heads=split_heads(ix.heads, tp_size, f"{self.model_type} indexer"),
                head_dim=ix.head_dim,
                dtype=ix.dtype or kvd,
                scale_block=ix.scale_block,
            )
        return RankGeometries(kv=kv, swa=swa, state=state, indexer=indexer)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Read a HuggingFace config.json dict; raises UnsupportedModelError for unknown types."""
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
            return reader(config)
        except KeyError as e:
            raise ConfigError(f"{model_type} config is missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"{model_type} config has a malformed value: {e}") from None


def stage_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """[start, end) of stage ``pp_rank``: layers split evenly, the first stages take the rest."""
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ConfigError(f"pp_size must be a positive integer, got {pp_size!r}")
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank must be in [0, {pp_size}), got {pp_rank!r}")
    if pp_size > num_layers:
        raise ConfigError(f"pp_size={pp_size} is larger than the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    end = start + base + (1 if pp_rank < extra else 0)
    return start, end


# ---------------------------------------------------------------------------------------------
# HuggingFace config readers


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


_READERS = {
    "llama": _dense,
    "mistral": _dense,
    "qwen2": _dense,
    "qwen3": _dense,
    "qwen3_moe": _dense,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
    "deepseek_v32": _deepseek_v32,
    "gpt_oss": _sliding,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "qwen3_next": _qwen3_next,
    "nemotron_h": _nemotron_h,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_READERS))
