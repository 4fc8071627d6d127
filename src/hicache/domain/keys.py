"""Page keys: the chained sha256 that names a full page of tokens, the same chain as SGLang's.

- PageKey: the 32-byte sha256 digest of one full page (bytes; ``page_hex`` gives the 64-hex form
  that StoreKey.page_hash and SGLang's ``get_hash_str`` use).
- pack_tokens: token ids as little-endian uint32 bytes (ConfigError for an id out of range).
- page_key: one link of the chain, sha256(prior digest || page's packed token ids).
- chain_keys: the keys of every FULL page of a token sequence (a trailing partial page has none),
  optionally continuing after a prior key.
- KeyChain / key_chain: the same keys as one bytes object of 32-byte digests, read as a
  sequence of keys without making a bytes object per page up front (a 131,072-page prompt's
  keys are 4 MiB; its match looks up a handful of them); ``prior`` is the key before the first.
- page_hex / key_of_hex: between the digest and its 64-hex-digit text.
- set_chain_hasher(hasher, name): hash long chains with another implementation of the same
  chain (hicache.adapters.native_keys installs a C one); it is checked against this module's
  chain on test vectors first, and refused (ConfigError) if any key differs (its ``blob``
  method too, when it has one: the keys joined, which key_chain uses). chain_hasher() names
  the one in use ("python" by default).

key(page 0) = sha256(LE-uint32 token ids of page 0); key(page n) = sha256(key(page n-1) digest
bytes || LE-uint32 token ids of page n). This is SGLang's ``get_hash_str(token_ids, prior_hash)``
(python/sglang/srt/mem_cache/hicache_storage.py, later moved to mem_cache/utils.py): it feeds
``bytes.fromhex(prior_hash)`` (the 32 digest bytes, not the hex text) and then each token as
``t.to_bytes(4, "little", signed=False)``; with no prior hash it feeds nothing first. What makes
bytes incompatible (model, dtype, layout, rank) is NOT in the key: see hicache.domain.namespace.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from hicache.domain.errors import ConfigError, shown
from hicache.domain.validators import is_int

PageKey = bytes
KEY_BYTES = 32

# The array typecode whose items are 4 bytes on this platform ('I' almost everywhere).
_FMT = f"{KEY_BYTES}s"
_COMPARE_KEYS = 2048  # keys per piece when KeyChain.starts_with compares
_U32 = next(code for code in ("I", "L", "H") if array(code).itemsize == 4)
_SWAP = sys.byteorder != "little"
_sha256 = hashlib.sha256

# (packed ids, bytes per page, prior key or None) -> the keys of every full page.
ChainHasher = Callable[[bytes, int, "bytes | None"], "list[bytes]"]
# Below this many pages the Python loop costs no more than a call into another implementation.
_HASHER_MIN_PAGES = 32
# (packed ids, bytes per page, prior key or None) -> the keys of every full page, joined.
BlobHasher = Callable[[bytes, int, "bytes | None"], bytes]
_hasher: ChainHasher | None = None
_blob_hasher: BlobHasher | None = None
_hasher_name = "python"


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ConfigError names the first bad id."""
    try:
        packed = array(_U32, token_ids)
    except (OverflowError, TypeError):
        bad = next((t for t in token_ids if not is_int(t) or not 0 <= int(t) < 2**32), token_ids)
        raise ConfigError(
            f"token id {shown(bad)}: expected an integer in [0, 2**32) (packed as little-endian uint32)"
        ) from None
    if _SWAP:  # pragma: no cover - big-endian hosts only
        packed.byteswap()
    return packed.tobytes()


def page_key(page_tokens: Sequence[int], prior: PageKey | None = None) -> PageKey:
    """sha256(prior digest || LE-uint32 ids): one link of the chain (any length of ids)."""
    h = _sha256(prior) if prior else _sha256()
    h.update(pack_tokens(page_tokens))
    return h.digest()


def _packed_pages(
    token_ids: Sequence[int] | bytes, page_size: int, prior: PageKey | None
) -> tuple[bytes, int, int]:
    """(packed ids, bytes per page, bytes of the full pages), the arguments checked."""
    if not is_int(page_size) or page_size <= 0:
        raise ConfigError(f"page_size must be a positive integer, got {shown(page_size)}")
    if prior is not None and (not isinstance(prior, bytes) or len(prior) != KEY_BYTES):
        raise ConfigError(f"prior key {shown(prior)}: expected {KEY_BYTES} digest bytes")
    if isinstance(token_ids, bytes):
        if len(token_ids) % 4:
            raise ConfigError(f"packed token ids: {len(token_ids)} bytes is not a multiple of 4")
        packed = token_ids
    else:
        packed = pack_tokens(token_ids)
    step = page_size * 4
    return packed, step, len(packed) // step * step


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
    packed, step, end = _packed_pages(token_ids, page_size, prior)
    if _hasher is not None and end >= _HASHER_MIN_PAGES * step:
        return _hasher(packed, step, prior)
    return _python_chain(packed, step, prior)


def key_chain(
    token_ids: Sequence[int] | bytes,
    page_size: int,
    *,
    prior: PageKey | None = None,
) -> KeyChain:
    """``chain_keys`` as a KeyChain: the same keys, held as one bytes object."""
    packed, step, end = _packed_pages(token_ids, page_size, prior)
    if _blob_hasher is not None and end >= _HASHER_MIN_PAGES * step:
        return KeyChain(_blob_hasher(packed, step, prior), prior=prior)
    if _hasher is not None and end >= _HASHER_MIN_PAGES * step:
        return KeyChain(b"".join(_hasher(packed, step, prior)), prior=prior)
    return KeyChain(b"".join(_python_chain(packed, step, prior)), prior=prior)


class KeyChain(Sequence[PageKey]):
    """Page keys held as one bytes object of ``KEY_BYTES``-byte digests (immutable).

    A sequence of keys like the list ``chain_keys`` returns (indexing gives a key; it equals a
    list or tuple of the same keys), but a key's bytes object is made only when it is read:
    a long prompt's match reads a few. ``prior`` is the key before the first (None: unknown,
    or the chain starts there). A slice ``[a:b]`` is a KeyChain sharing the bytes (its prior:
    the key before ``a``); ``blob`` gives the joined digests; ``starts_with(keys)`` says
    whether the chain begins with ``keys``. Anything may be held here: nothing trusts a
    KeyChain to be a sha256 chain (the prefix index checks the keys it uses).
    """

    __slots__ = ("_blob", "_n", "_off", "_prior")

    def __init__(self, blob: bytes, *, prior: PageKey | None = None) -> None:
        if not isinstance(blob, bytes) or len(blob) % KEY_BYTES:
            raise ConfigError(
                f"key chain: expected bytes made of {KEY_BYTES}-byte keys, got "
                f"{type(blob).__name__} of {len(blob) if isinstance(blob, bytes) else '?'} bytes"
            )
        if prior is not None and (not isinstance(prior, bytes) or len(prior) != KEY_BYTES):
            raise ConfigError(f"key chain: prior key {shown(prior)}: expected {KEY_BYTES} bytes")
        self._blob = blob
        self._off = 0
        self._n = len(blob) // KEY_BYTES
        self._prior = prior

    @classmethod
    def _view(cls, blob: bytes, off: int, n: int, prior: PageKey | None) -> KeyChain:
        chain = cls.__new__(cls)
        chain._blob, chain._off, chain._n, chain._prior = blob, off, n, prior
        return chain

    @property
    def prior(self) -> PageKey | None:
        return self._prior

    @property
    def blob(self) -> bytes:
        """The keys joined (the shared bytes when this chain is all of them)."""
        end = self._off + self._n * KEY_BYTES
        if self._off == 0 and end == len(self._blob):
            return self._blob
        return self._blob[self._off : end]

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> PageKey: ...

    @overload
    def __getitem__(self, i: slice) -> KeyChain: ...

    def __getitem__(self, i: int | slice) -> PageKey | KeyChain:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step != 1:
                raise ConfigError(f"key chain: slices take every key (step 1), not step {step}")
            n = max(0, stop - start)
            prior = self._prior if start == 0 else self[start - 1]
            return KeyChain._view(self._blob, self._off + start * KEY_BYTES, n, prior)
        if not is_int(i):
            raise ConfigError(f"key chain index {shown(i)}: expected an integer or a slice")
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(f"key chain index {i} out of range for {self._n} keys")
        at = self._off + j * KEY_BYTES
        return self._blob[at : at + KEY_BYTES]

    def _keys(self) -> tuple[PageKey, ...]:
        if not self._n:
            return ()
        keys: tuple[PageKey, ...] = struct.unpack_from(_FMT * self._n, self._blob, self._off)
        return keys

    def __iter__(self) -> Iterator[PageKey]:
        return iter(self._keys())

    def __reversed__(self) -> Iterator[PageKey]:
        return reversed(self._keys())

    def starts_with(self, keys: Sequence[PageKey]) -> bool:
        """Whether the first ``len(keys)`` keys of this chain are ``keys``, in order."""
        n = len(keys)
        if n > self._n:
            return False
        # In pieces of 64 KiB: no temporary as large as a long prompt's keys (4 MiB at 131,072
        # pages), whose fresh pages cost more than the comparison.
        blob, off, step = self._blob, self._off, _COMPARE_KEYS
        for i in range(0, n, step):
            piece = keys[i : i + step]
            at = off + i * KEY_BYTES
            if b"".join(piece) != blob[at : at + len(piece) * KEY_BYTES]:
                return False
        return True

    def __eq__(self, other: object) -> bool:
        if isinstance(other, KeyChain):
            return self._n == other._n and self.blob == other.blob
        if isinstance(other, (list, tuple)):
            return len(other) == self._n and list(other) == list(self._keys())
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._keys())  # equal to the tuple of the same keys, as __eq__ says

    def __add__(self, other: object) -> list[PageKey]:
        if isinstance(other, (KeyChain, list)):
            return [*self._keys(), *other]
        return NotImplemented

    def __radd__(self, other: object) -> list[PageKey]:
        if isinstance(other, list):
            return [*other, *self._keys()]
        return NotImplemented

    def __repr__(self) -> str:
        return f"<KeyChain of {self._n} keys>"


def _python_chain(packed: bytes, step: int, prior: PageKey | None) -> list[PageKey]:
    end = len(packed) // step * step
    keys: list[PageKey] = []
    append = keys.append
    sha = _sha256
    h = prior if prior is not None else b""
    for off in range(0, end, step):
        h = sha(h + packed[off : off + step]).digest()
        append(h)
    return keys


def set_chain_hasher(hasher: ChainHasher | None, *, name: str = "custom") -> None:
    """Hash chains of 32 pages or more with ``hasher`` (None: this module's Python chain).

    ``hasher(packed, page_bytes, prior)`` must give exactly this module's keys, and
    ``hasher.blob(packed, page_bytes, prior)``, if it has one, those keys joined (key_chain
    uses it): both are run on test vectors (page sizes 1, 3, 16 and 64, with and without a
    prior key, and a trailing partial page) and refused with ConfigError naming the first
    differing case otherwise.
    """
    global _hasher, _blob_hasher, _hasher_name
    if hasher is None:
        _hasher, _blob_hasher, _hasher_name = None, None, "python"
        return
    if not callable(hasher):
        raise ConfigError(f"chain hasher {hasher!r}: expected a callable, or None")
    blob = getattr(hasher, "blob", None)
    if blob is not None and not callable(blob):
        raise ConfigError(f"chain hasher {name!r}: its blob is not callable")
    packed = pack_tokens([(i * 2654435761) % 2**32 for i in range(64 * 40 + 5)])
    for page_size in (1, 3, 16, 64):
        step = page_size * 4
        for prior in (None, _sha256(b"prior").digest()):
            want = _python_chain(packed, step, prior)
            # A hasher that fails is refused like one that differs.
            try:
                differs = "keys" if list(hasher(packed, step, prior)) != want else ""
            except Exception:
                differs = "keys"
            if not differs and blob is not None:
                try:
                    differs = "joined keys" if blob(packed, step, prior) != b"".join(want) else ""
                except Exception:
                    differs = "joined keys"
            if differs:
                raise ConfigError(
                    f"chain hasher {name!r}: its {differs} differ from sha256 chain keys at "
                    f"page size {page_size} (prior {'set' if prior else 'none'}); not used"
                )
    _hasher, _blob_hasher, _hasher_name = hasher, blob, name


def chain_hasher() -> str:
    """The name of the implementation that hashes long chains ("python" by default)."""
    return _hasher_name


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
        raise ConfigError(f"page key {shown(text)}: expected 64 hex digits (a sha256 digest)")
    return key
