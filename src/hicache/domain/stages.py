"""Pipeline stages: which [start, end) layer range a pipeline rank runs.

- PPSplit: the serving engine's rule for splitting layers over pipeline ranks (vllm, sglang).
- stage_range: [start, end) of one pipeline rank under a rule (vLLM's by default).
- stage_sizes: the layer count of every stage under a rule.
- check_stage: a [start, end) given by the serving engine, checked against the model.

vLLM (vllm/distributed/utils.py get_pp_indices): every stage gets num_layers // pp layers and the
remainder goes one each to the stages before the last, from the second-to-last backwards.
SGLang (python/sglang/srt/distributed/utils.py get_pp_indices): the remainder goes one each to the
last stages. Neither reads a partition override here: an embedder whose engine was given one
(VLLM_PP_LAYER_PARTITION, SGLANG_PP_LAYER_PARTITION) passes the stage's [start, end) instead.
"""

from __future__ import annotations

import enum

from hicache.domain.errors import ConfigError, shown


class PPSplit(enum.Enum):
    VLLM = "vllm"
    SGLANG = "sglang"

    @classmethod
    def parse(cls, value: str | PPSplit) -> PPSplit:
        if isinstance(value, PPSplit):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"pp_split must be 'vllm' or 'sglang', got {shown(value)}")
        try:
            return cls(value.strip().lower())
        except ValueError:
            raise ConfigError(f"pp_split must be 'vllm' or 'sglang', got {shown(value)}") from None


def _check(num_layers: int, pp_size: int, pp_rank: int) -> None:
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ConfigError(f"num_layers must be a positive integer, got {shown(num_layers)}")
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ConfigError(f"pp_size must be a positive integer, got {shown(pp_size)}")
    if not isinstance(pp_rank, int) or isinstance(pp_rank, bool) or not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank must be in [0, {pp_size}), got {shown(pp_rank)}")
    if pp_size > num_layers:
        raise ConfigError(f"pp_size={pp_size} is larger than the model's {num_layers} layers")


def stage_sizes(num_layers: int, pp_size: int, split: PPSplit | str = PPSplit.VLLM) -> list[int]:
    """The number of layers of every stage, in rank order."""
    _check(num_layers, pp_size, 0)
    rule = PPSplit.parse(split)
    base, extra = divmod(num_layers, pp_size)
    sizes = [base] * pp_size
    if rule is PPSplit.VLLM:
        # One each to the stages before the last, walking back from the second-to-last.
        for i in range(2, extra + 2):
            sizes[-i] += 1
    else:
        for i in range(1, extra + 1):
            sizes[-i] += 1
    return sizes


def stage_range(
    num_layers: int, pp_size: int, pp_rank: int, split: PPSplit | str = PPSplit.VLLM
) -> tuple[int, int]:
    """[start, end) of stage ``pp_rank`` under ``split`` (vLLM's get_pp_indices by default)."""
    _check(num_layers, pp_size, pp_rank)
    sizes = stage_sizes(num_layers, pp_size, split)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def check_stage(num_layers: int, start: int, end: int) -> tuple[int, int]:
    """A stage range given by the serving engine: integers with 0 <= start < end <= num_layers."""
    for name, v in (("pp_start", start), ("pp_end", end)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"{name} must be an integer, got {shown(v)}")
    if not 0 <= start < end <= num_layers:
        raise ConfigError(
            f"stage [pp_start, pp_end) = [{start}, {end}) is not a non-empty range of the "
            f"model's {num_layers} layers"
        )
    return start, end
