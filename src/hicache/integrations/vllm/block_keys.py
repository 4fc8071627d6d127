"""Page keys of blocks with extra keys (LoRA, multimodal inputs, cache_salt, prompt embeddings).

- UnkeyableError: a block's extra keys hold an element of a kind or shape this module does not
  encode; a request with one is not cached (neither matched nor saved).
- extras_digest(extra_keys): the sha256 of a strict, versioned encoding of one block's extra-key
  elements (the tuples vLLM's ``generate_block_hash_extra_keys`` returns, plus the prompt's
  token/embedding mask); the same bytes in every process and Python version.
- BlockExtras: what the scheduler side reads a request's extras through: ``digests(start,
  stop)``, one digest (or None: tokens alone) per block of [start, stop).
- chain_block_keys(tokens, block_size, digests, prior): the chained keys of full blocks, each
  depending on every earlier block's tokens and extras. A block without extras is a link of
  hicache.domain.keys' chain (sha256(prior || tokens), C-accelerated on long runs), so a
  request without extras has exactly the keys of ``chain_keys``; a block with extras is
  sha256(prior or NO_PRIOR || tokens || digest), a message 32 bytes longer than any plain
  link of the same block size, so the two kinds never share a key.

vLLM-free and pure: hicache.integrations.vllm.request_keys reads vLLM's Request into digests.
The kinds and their fields follow vllm/v1/core/kv_cache_utils.py (vLLM 0.32:
``_gen_lora_extra_hash_keys``, ``_gen_mm_extra_hash_keys``, ``_gen_prompt_embeds_extra_hash_keys``,
``generate_block_hash_extra_keys``); vLLM hashes them with its own block hash (pickle or CBOR
under a seed that may be random per process), which hicache does not reuse.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Protocol

from hicache.domain.errors import ConfigError, HiCacheError
from hicache.domain.keys import KEY_BYTES, PageKey, chain_keys, pack_tokens
from hicache.domain.validators import is_int

ENCODING = b"hicache.vllm.extra-keys.v1\x00"
# The prior of a first block that has extras (a plain first block has none: SGLang's chain).
NO_PRIOR = hashlib.sha256(b"hicache.vllm.extra-keys.v1 first block").digest()
# The mask hicache adds to vLLM's extra keys for a prompt that mixes token ids and embeddings
# (Request.prompt_is_token_ids): vLLM zeroes the ids at embedding positions, so the mask tells a
# token 0 from an embedding there.
IS_TOKEN_IDS = "hicache.is_token_ids"

# Each kind and the types of its fields after the tag, in order.
_KINDS: dict[str, tuple[type, ...]] = {
    "lora": (str, str),  # adapter name, adapter path
    "mm": (str, int),  # item identifier (its content hash), offset from the block's first token
    "cache_salt": (str,),
    "prompt_embeds": (bytes,),  # sha256 of the block's embeddings
    IS_TOKEN_IDS: (bytes,),  # one byte per prompt position of the block: 1 token id, 0 embedding
}
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


class UnkeyableError(HiCacheError):
    """A block's extra keys hold something hicache cannot encode into a page key."""


class BlockExtras(Protocol):
    """A request's per-block extras as digests (hicache.integrations.vllm.request_keys)."""

    def digests(self, start: int, stop: int) -> Sequence[bytes | None]:
        """One ``extras_digest`` per block of [start, stop) (None: the tokens alone key it);
        UnkeyableError when a block's extras cannot be encoded."""
        ...


def _field(value: object, kind: type, where: str) -> bytes:
    if kind is str and isinstance(value, str):
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:
            raise UnkeyableError(f"{where}: {value!r} is not encodable as UTF-8") from None
        return b"s" + _U32.pack(len(data)) + data
    if kind is bytes and isinstance(value, bytes):
        return b"b" + _U32.pack(len(value)) + value
    if kind is int and is_int(value):
        number = int(value)  # type: ignore[call-overload]  # is_int: an int, not a bool
        if not -(2**63) <= number < 2**63:
            raise UnkeyableError(f"{where}: {number} is out of the signed 64-bit range")
        return b"i" + _I64.pack(number)
    raise UnkeyableError(
        f"{where}: {value!r} ({type(value).__name__}) where {kind.__name__} was expected"
    )


def encode_extras(extra_keys: Sequence[object]) -> bytes:
    """The strict encoding of one block's extra-key elements, in their order.

    Each element is a tuple ``(kind, field, ...)`` of a known kind with exactly its fields'
    types (str as UTF-8, bytes, int as signed 64-bit; bool is not an int here); each field is
    its type letter, then its length (u32 little-endian) and bytes, or 8 bytes for an int. The
    number of elements comes first. Anything else is an UnkeyableError naming it.
    """
    if not isinstance(extra_keys, tuple | list):
        raise UnkeyableError(
            f"extra keys {extra_keys!r}: expected a tuple of elements, got "
            f"{type(extra_keys).__name__}"
        )
    parts = [ENCODING, _U32.pack(len(extra_keys))]
    for n, element in enumerate(extra_keys):
        if not isinstance(element, tuple) or not element:
            raise UnkeyableError(
                f"extra key element {n} {element!r}: expected a tuple (kind, fields...)"
            )
        kind = element[0]
        fields = _KINDS.get(kind) if isinstance(kind, str) else None
        if fields is None:
            raise UnkeyableError(
                f"extra key element {n} of kind {kind!r}: hicache keys only "
                f"{', '.join(sorted(_KINDS))}; a request with it is not cached"
            )
        if len(element) != len(fields) + 1:
            raise UnkeyableError(
                f"extra key element {n} {element!r}: kind {kind!r} has {len(fields)} fields, "
                f"got {len(element) - 1}"
            )
        parts.append(_field(kind, str, f"extra key element {n} kind"))
        for i, (value, ftype) in enumerate(zip(element[1:], fields, strict=True)):
            parts.append(_field(value, ftype, f"extra key element {n} ({kind}) field {i}"))
    return b"".join(parts)


def extras_digest(extra_keys: Sequence[object]) -> bytes:
    """sha256 of ``encode_extras(extra_keys)``: what one block's extras add to its page key."""
    return hashlib.sha256(encode_extras(extra_keys)).digest()


def chain_block_keys(
    token_ids: Sequence[int] | bytes,
    block_size: int,
    digests: Sequence[bytes | None],
    *,
    prior: PageKey | None = None,
) -> list[PageKey]:
    """The keys of every full block of ``token_ids``; ``digests[i]``: block i's extras digest.

    ``prior`` continues a chain (the key of the block before the first). Consecutive blocks
    without extras go through ``chain_keys`` as one run; consecutive blocks with extras too,
    each block's tokens followed by its digest (a page of ``block_size + 8`` uint32 words).
    ConfigError when ``digests`` has fewer entries than full blocks or one is not 32 bytes.
    """
    if not is_int(block_size) or block_size <= 0:
        raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
    packed = token_ids if isinstance(token_ids, bytes) else pack_tokens(token_ids)
    step = block_size * 4
    n = len(packed) // step
    if len(digests) < n:
        raise ConfigError(
            f"block extras: {len(digests)} digests for {n} full blocks; expected one per block"
        )
    for d in digests[:n]:
        if d is not None and (not isinstance(d, bytes) or len(d) != KEY_BYTES):
            raise ConfigError(f"block extras digest {d!r}: expected {KEY_BYTES} bytes or None")
    if not any(digests[:n]):
        return chain_keys(packed[: n * step], block_size, prior=prior)
    keys: list[PageKey] = []
    i = 0
    while i < n:
        j = i + 1
        if digests[i] is None:
            while j < n and digests[j] is None:
                j += 1
            keys.extend(chain_keys(packed[i * step : j * step], block_size, prior=prior))
        else:
            while j < n and digests[j] is not None:
                j += 1
            pieces: list[bytes] = []
            for b in range(i, j):
                pieces.append(packed[b * step : (b + 1) * step])
                pieces.append(digests[b])  # type: ignore[arg-type]  # not None in this run
            run = b"".join(pieces)
            keys.extend(chain_keys(run, block_size + KEY_BYTES // 4, prior=prior or NO_PRIOR))
        prior = keys[-1]
        i = j
    return keys


__all__ = [
    "ENCODING",
    "IS_TOKEN_IDS",
    "NO_PRIOR",
    "BlockExtras",
    "UnkeyableError",
    "chain_block_keys",
    "encode_extras",
    "extras_digest",
]
