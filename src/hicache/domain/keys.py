"""Page keys: the chained sha256 that names a full page of tokens, the same chain as SGLang's.

- PageKey: the 32-byte sha256 digest of one full page (bytes; ``page_hex`` gives the 64-hex form
  that StoreKey.page_hash and SGLang's ``get_hash_str`` use).
- pack_tokens: token ids as little-endian uint32 bytes (ConfigError for an id out of range).
- page_key: one link of the chain, sha256(prior digest || page's packed token ids).
- chain_keys: the keys of every FULL page of a token sequence (a trailing partial page has none),
  optionally continuing after a prior key.
- page_hex / key_of_hex: between the digest and its 64-hex-digit text.

key(page 0) = sha256(LE-uint32 token ids of page 0); key(page n) = sha256(key(page n-1) digest
bytes || LE-uint32 token ids of page n). This is SGLang's ``get_hash_str(token_ids, prior_hash)``
(python/sglang/srt/mem_cache/hicache_storage.py, later moved to mem_cache/utils.py): it feeds
``bytes.fromhex(prior_hash)`` (the 32 digest bytes, not the hex text) and then each token as
``t.to_bytes(4, "little", signed=False)``; with no prior hash it feeds nothing first. What makes
bytes incompatible (model, dtype, layout, rank) is NOT in the key: see hicache.domain.namespace.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from hicache.domain.errors import ConfigError
from hicache.domain.validators import is_int

PageKey = bytes
KEY_BYTES = 32

# The array typecode whose items are 4 bytes on this platform ('I' almost everywhere).
_U32 = next(code for code in ("I", "L", "H") if array(code).itemsize == 4)
_SWAP = sys.byteorder != "little"
_sha256 = hashlib.sha256


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ConfigError names the first bad id."""
    try:
        packed = array(_U32, token_ids)
    except (OverflowError, TypeError):
        bad = next(
            (t for t in token_ids if not is_int(t) or not 0 <= int(t) < 2**32), token_ids
        )
        raise ConfigError(
            f"token id {bad!r}: expected an integer in [0, 2**32) (packed as little-endian uint32)"
        ) from None
    if _SWAP:  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return packed.tobytes()


def page_key(page_tokens: Sequence[int], prior: PageKey | None = None) -> PageKey:
    """sha256(prior digest || LE-uint32 ids): one link of the chain (any length of ids)."""
    h = _sha256(prior) if prior else _sha256()
    h.update(pack_tokens(page_tokens))
    return h.digest()


def chain_keys(
    token_ids: Sequence[int] | bytes,
    page_size: int,
    *,
    prior: PageKey | None = None,
) -> list[PageKey]:
    """The keys of every full page of ``token_ids`` (already packed bytes are accepted too).

    ``prior`` continues a chain: the keys of tokens that follow a known page. A trailing
    partial page gets no key.
    """
    if not is_int(page_size) or page_size <= 0:
        raise ConfigError(f"page_size must be a positive integer, got {page_size!r}")
    if prior is not None and (not isinstance(prior, bytes) or len(prior) != KEY_BYTES):
        raise ConfigError(f"prior key {prior!r}: expected {KEY_BYTES} digest bytes")
    if isinstance(token_ids, bytes):
        if len(token_ids) % 4:
            raise ConfigError(f"packed token ids: {len(token_ids)} bytes is not a multiple of 4")
        packed = token_ids
    else:
        packed = pack_tokens(token_ids)
    step = page_size * 4
    end = len(packed) // step * step
    keys: list[PageKey] = []
    append = keys.append
    sha = _sha256
    h = prior if prior is not None else b""
    for off in range(0, end, step):
        h = sha(h + packed[off : off + step]).digest()
        append(h)
    return keys


def page_hex(key: PageKey) -> str:
    """The 64 lowercase hex digits of a key (StoreKey.page_hash, SGLang's hash strings)."""
    return key.hex()


def key_of_hex(text: str) -> PageKey:
    """The digest of 64 hex digits; ConfigError for anything else."""
    try:
        key = bytes.fromhex(text)
    except (ValueError, TypeError):
        key = b""
    if len(key) != KEY_BYTES:
        raise ConfigError(f"page key {text!r}: expected 64 hex digits (a sha256 digest)")
    return key
