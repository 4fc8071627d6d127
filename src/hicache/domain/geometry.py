"""Pool geometries: what one unit (a token or a state slot) of one layer occupies.

- Unit: TOKEN for attention-like pools, SLOT for recurrent state pools (page size 1).
- BufferSpec: one named tensor of a pool per unit per layer (shape, dtype, bytes).
- KVGeometry: MHA/GQA K and V (K and V head dims may differ); also used for sliding-window pools.
- MLAGeometry: one latent row (kv_lora_rank + qk_rope_head_dim, or an overriding width).
- IndexerGeometry: K-only sparse-attention indexer, plain dtype or fp8 with float32 block scales.
- StateGeometry: named state tensors (conv states, a temporal state) of Mamba2 / Gated DeltaNet.
- mamba2_state / gated_deltanet_state / kimi_delta_state: recurrent state of those layer kinds.
- short_conv_state: conv-only state (Inkling's short convolutions), one tensor per stream.
"""

from __future__ import annotations

import enum
import math
from typing import Protocol

import attrs

from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError, shown
from hicache.domain.validators import optional_positive_int, positive_int


class Unit(enum.Enum):
    TOKEN = "token"
    SLOT = "slot"


def _int_tuple(value: object) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"a shape must be a tuple of ints, got {shown(value)}")
    return tuple(value)


def _state_tensors(value: object) -> tuple[StateTensor, ...]:
    if not isinstance(value, (tuple, list)):
        raise ConfigError(f"state tensors must be a sequence, got {shown(value)}")
    return tuple(value)


def _shape(
    _inst: object, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]
) -> None:
    if not value or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in value):
        raise ConfigError(
            f"{attribute.name} must be a non-empty tuple of positive ints, got {shown(value)}"
        )


@attrs.frozen
class BufferSpec:
    """One tensor of a pool, per unit per layer. ``head_axis`` says ``shape[0]`` counts heads."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_shape)
    dtype: DType
    head_axis: bool = False

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.elements * self.dtype.itemsize


class Geometry(Protocol):
    """What every pool geometry answers."""

    @property
    def kind(self) -> str: ...

    @property
    def unit(self) -> Unit: ...

    @property
    def buffers(self) -> tuple[BufferSpec, ...]: ...

    @property
    def bytes_per_unit_per_layer(self) -> int: ...


def _sum_bytes(buffers: tuple[BufferSpec, ...]) -> int:
    return sum(b.nbytes for b in buffers)


@attrs.frozen(kw_only=True)
class KVGeometry:
    """Full-attention (or sliding-window) MHA/GQA: K and V per token, per rank."""

    kv_heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    v_head_dim: int | None = attrs.field(default=None, validator=optional_positive_int)
    dtype: DType = DType.BF16

    kind = "mha"
    unit = Unit.TOKEN

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return (
            BufferSpec("k", (self.kv_heads, self.head_dim), self.dtype, head_axis=True),
            BufferSpec("v", (self.kv_heads, self.value_dim), self.dtype, head_axis=True),
        )

    @property
    def bytes_per_unit_per_layer(self) -> int:
        return _sum_bytes(self.buffers)


@attrs.frozen(kw_only=True)
class MLAGeometry:
    """Multi-head latent attention: one latent row per token, replicated on every TP rank.

    ``row_width`` overrides the row's element count for packed formats (e.g. fp8 rows that carry
    their scales); by default the row is ``kv_lora_rank + qk_rope_head_dim`` elements.
    """

    kv_lora_rank: int = attrs.field(validator=positive_int)
    qk_rope_head_dim: int = attrs.field(validator=positive_int)
    dtype: DType = DType.BF16
    row_width: int | None = attrs.field(default=None, validator=optional_positive_int)

    kind = "mla"
    unit = Unit.TOKEN

    @property
    def width(self) -> int:
        return (
            self.kv_lora_rank + self.qk_rope_head_dim if self.row_width is None else self.row_width
        )

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return (BufferSpec("kv", (self.width,), self.dtype),)

    @property
    def bytes_per_unit_per_layer(self) -> int:
        return _sum_bytes(self.buffers)


@attrs.frozen(kw_only=True)
class IndexerGeometry:
    """K-only sparse-attention indexer.

    Plain form (MiniMax sparse attention): ``heads x head_dim`` elements of ``dtype``.
    Block-scaled form (DeepSeek-V3.2 lightning indexer): fp8 values plus one float32 scale per
    ``scale_block`` elements, stored as bytes: ``heads x (head_dim + ceil(head_dim/block) x 4)``.
    """

    heads: int = attrs.field(validator=positive_int)
    head_dim: int = attrs.field(validator=positive_int)
    dtype: DType = DType.BF16
    scale_block: int | None = attrs.field(default=None, validator=optional_positive_int)

    kind = "indexer"
    unit = Unit.TOKEN

    def __attrs_post_init__(self) -> None:
        if self.scale_block is not None and not self.dtype.is_fp8:
            raise ConfigError(
                f"indexer scale_block={self.scale_block} needs an fp8 dtype, got {self.dtype.value}"
            )

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        if self.scale_block is None:
            return (BufferSpec("k", (self.heads, self.head_dim), self.dtype, head_axis=True),)
        per_head = self.head_dim * self.dtype.itemsize + 4 * math.ceil(
            self.head_dim / self.scale_block
        )
        return (BufferSpec("k", (self.heads, per_head), DType.UINT8, head_axis=True),)

    @property
    def bytes_per_unit_per_layer(self) -> int:
        return _sum_bytes(self.buffers)


@attrs.frozen
class StateTensor:
    """One named state tensor of a recurrent layer, per slot."""

    name: str
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple, validator=_shape)
    dtype: DType


@attrs.frozen(kw_only=True)
class StateGeometry:
    """Recurrent state: a list of named per-rank tensors (shape, dtype) per slot per layer."""

    tensors: tuple[StateTensor, ...] = attrs.field(converter=_state_tensors)
    family: str = "mamba2"

    kind = "state"
    unit = Unit.SLOT

    def __attrs_post_init__(self) -> None:
        if not self.tensors:
            raise ConfigError("a state geometry needs at least one state tensor, got none")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ConfigError(f"state tensor names must be unique, got {names}")

    @property
    def buffers(self) -> tuple[BufferSpec, ...]:
        return tuple(BufferSpec(t.name, t.shape, t.dtype) for t in self.tensors)

    @property
    def bytes_per_unit_per_layer(self) -> int:
        return _sum_bytes(self.buffers)


AnyGeometry = KVGeometry | MLAGeometry | IndexerGeometry | StateGeometry


def mamba2_state(
    *,
    heads: int,
    head_dim: int,
    state_size: int,
    n_groups: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    ssm_dtype: DType = DType.FP32,
    intermediate: int | None = None,
) -> StateGeometry:
    """Mamba2 per-rank state: conv (conv_dim, kernel-1) and temporal (heads, head_dim, state).

    conv_dim = intermediate + 2 x n_groups x state_size, all per rank; ``intermediate`` (d_ssm
    per rank) defaults to heads x head_dim.
    """
    if conv_kernel < 2:
        raise ConfigError(f"conv_kernel must be at least 2, got {conv_kernel}")
    inner = heads * head_dim if intermediate is None else intermediate
    conv_dim = inner + 2 * n_groups * state_size
    return StateGeometry(
        tensors=(
            StateTensor("conv", (conv_dim, conv_kernel - 1), conv_dtype),
            StateTensor("temporal", (heads, head_dim, state_size), ssm_dtype),
        ),
        family="mamba2",
    )


def gated_deltanet_state(
    *,
    key_heads: int,
    value_heads: int,
    key_dim: int,
    value_dim: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    ssm_dtype: DType = DType.FP32,
) -> StateGeometry:
    """Gated DeltaNet per-rank state: conv (conv_dim, kernel-1), temporal (v_heads, v_dim, k_dim).

    The order of SGLang's Mamba2StateShape.create for Qwen3-Next (head_dim = value head dim,
    state_size = key head dim).
    """
    if conv_kernel < 2:
        raise ConfigError(f"conv_kernel must be at least 2, got {conv_kernel}")
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    return StateGeometry(
        tensors=(
            StateTensor("conv", (conv_dim, conv_kernel - 1), conv_dtype),
            StateTensor("temporal", (value_heads, value_dim, key_dim), ssm_dtype),
        ),
        family="gated_deltanet",
    )


def kimi_delta_state(
    *,
    heads: int,
    head_dim: int,
    conv_kernel: int,
    conv_dtype: DType = DType.BF16,
    ssm_dtype: DType = DType.FP32,
) -> StateGeometry:
    """Kimi Delta Attention per-rank state (``heads`` already split over TP).

    conv (kernel-1, q + k + v channels) with the window axis first, as SGLang's
    KimiLinearStateShape keeps it, and temporal (heads, head_dim, head_dim).
    """
    if conv_kernel < 2:
        raise ConfigError(f"conv_kernel must be at least 2, got {conv_kernel}")
    return StateGeometry(
        tensors=(
            StateTensor("conv", (conv_kernel - 1, 3 * heads * head_dim), conv_dtype),
            StateTensor("temporal", (heads, head_dim, head_dim), ssm_dtype),
        ),
        family="kimi_delta",
    )


def short_conv_state(
    *, streams: tuple[tuple[str, int], ...], conv_kernel: int, dtype: DType = DType.BF16
) -> StateGeometry:
    """Conv-only state: one (kernel-1, channels) tensor per named stream, no temporal state."""
    if conv_kernel < 2:
        raise ConfigError(f"conv_kernel must be at least 2, got {conv_kernel}")
    return StateGeometry(
        tensors=tuple(StateTensor(name, (conv_kernel - 1, dim), dtype) for name, dim in streams),
        family="short_conv",
    )
