"""What of a vLLM Request goes into hicache's page keys: its tokens and each block's extra keys.

- prompt_tokens(request): the prompt's token ids as vLLM hashes them (``all_token_ids`` up to
  ``num_prompt_tokens``: where the prompt is given as embeddings, vLLM's zeroes).
- request_extras(request, block_size): a RequestExtras, or None for a request whose blocks vLLM
  keys by their tokens alone (no LoRA adapter, multimodal item, cache_salt, prompt embeddings):
  such a request keeps the plain token chain and its cost.
- RequestExtras: hicache.integrations.vllm.block_keys.BlockExtras over one Request: for each
  block it calls vLLM's own ``generate_block_hash_extra_keys`` (so a block carries exactly the
  extra keys vLLM's prefix cache puts in its hash for it), adds the prompt's token/embedding
  mask where the prompt mixes them, and encodes them with ``extras_digest`` (strict, the same
  in every process: vLLM's own block hash may be seeded at random per process).

Reference (vLLM 0.32): vllm/v1/core/kv_cache_utils.py (``generate_block_hash_extra_keys`` and
the ``_gen_*_extra_hash_keys`` it calls, ``get_request_block_hasher``), vllm/v1/request.py
(``Request``: ``lora_request``, ``mm_features``, ``cache_salt``, ``prompt_embeds``,
``prompt_is_token_ids``), vllm/multimodal/utils.py (``get_mm_features_in_window``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hicache.integrations.vllm.block_keys import IS_TOKEN_IDS, UnkeyableError, extras_digest

if TYPE_CHECKING:
    from vllm.v1.request import Request

# vLLM's generate_block_hash_extra_keys(request, start token, end token, start mm index)
# -> (extra keys or None, next mm index).
ExtraKeysFn = Callable[[Any, int, int, int], tuple[Any, int]]


def prompt_tokens(request: Request) -> list[int]:
    """The prompt's token ids as vLLM's block hashes and the connector's saves see them."""
    tokens: list[int] = request.all_token_ids[: request.num_prompt_tokens]
    return tokens


def has_extras(request: Request) -> bool:
    """Whether vLLM 0.32 gives any block of ``request`` extra keys (the inputs
    ``generate_block_hash_extra_keys`` reads), or the prompt mixes token ids and embeddings."""
    return bool(
        request.lora_request
        or request.mm_features
        or request.cache_salt
        or request.prompt_embeds is not None
        or request.prompt_is_token_ids is not None
    )


def request_extras(
    request: Request, block_size: int, *, extra_keys: ExtraKeysFn | None = None
) -> RequestExtras | None:
    """The request's extras, or None when its blocks are keyed by their tokens alone."""
    if extra_keys is None and not has_extras(request):
        return None
    return RequestExtras(request, block_size, extra_keys=extra_keys)


def _vllm_extra_keys() -> ExtraKeysFn:
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return generate_block_hash_extra_keys  # type: ignore[no-any-return]


def _mm_start(request: Request, start_token: int, block_size: int) -> int:
    """The index of the first multimodal item that can overlap a block starting at
    ``start_token`` (what vLLM's own block hasher passes on, get_request_block_hasher)."""
    features = request.mm_features
    if start_token == 0 or not features:
        return 0
    last = features[-1].mm_position
    if last.offset + last.length <= start_token:
        return 0
    from vllm.multimodal.utils import get_mm_features_in_window

    lo, _ = get_mm_features_in_window(features, start_token, start_token + block_size)
    return int(lo)


class RequestExtras:
    """BlockExtras over one vLLM Request (read at each call: a streaming session's later
    items are seen). ``extra_keys``: vLLM's ``generate_block_hash_extra_keys`` by default."""

    def __init__(
        self, request: Request, block_size: int, *, extra_keys: ExtraKeysFn | None = None
    ) -> None:
        self.request = request
        self.block_size = block_size
        self._extra_keys = extra_keys or _vllm_extra_keys()

    def digests(self, start: int, stop: int) -> list[bytes | None]:
        """One digest per block of [start, stop); UnkeyableError names a block whose extras
        hicache cannot encode (or whose extra keys vLLM's function failed to give)."""
        request, bs, fn = self.request, self.block_size, self._extra_keys
        mask = request.prompt_is_token_ids
        out: list[bytes | None] = []
        last: object = None
        digest: bytes | None = None
        try:
            mm = _mm_start(request, start * bs, bs)
        except Exception as exc:
            raise UnkeyableError(
                f"request {request.request_id!r}: its multimodal items cannot be placed "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        for b in range(start, stop):
            begin, end = b * bs, (b + 1) * bs
            try:
                extra, mm = fn(request, begin, end, mm)
            except Exception as exc:
                raise UnkeyableError(
                    f"request {request.request_id!r} block {b}: vLLM's extra keys failed "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            if mask is not None and begin < len(mask):
                flags = bytes(1 if is_token else 0 for is_token in mask[begin:end])
                extra = (*(extra or ()), (IS_TOKEN_IDS, flags))
            if extra is None:
                out.append(None)
                continue
            if extra != last or digest is None:  # LoRA: the same extras on every block
                digest = extras_digest(extra)
                last = extra
            out.append(digest)
        return out


__all__ = [
    "ExtraKeysFn",
    "RequestExtras",
    "has_extras",
    "prompt_tokens",
    "request_extras",
]
