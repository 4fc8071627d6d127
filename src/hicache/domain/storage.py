"""The storage port: the face of an L3 store (a directory, Mooncake Store, a plug-in), torch-free.

- StoreStatus: the outcome of one key of a batch (OK, MISS, CORRUPT, FULL, TRANSIENT, INVALID,
  FATAL).
- StoreKey: one object of one pool for one page: the page's chained hash and the namespace of
  everything that makes bytes incompatible (kept beside the hash, never folded into it).
- PageBuffer: the bytes of one page of one pool in host memory, as one or more writable
  segments (a page of a layer-first pool is scattered over its layers).
- StoreHealth: a frozen snapshot of a store's state (usable, and why not).
- HostPageBuffers: the port that gives the PageBuffer of one page of one host pool (the engine
  reads and writes host pages through it without importing the adapters).
- Store: batch exists (a hint), batch get into host pages, batch put from host pages, remove,
  health, close. Calls are synchronous and may block: the engine calls them off its event loop.
  Every batch call takes a deadline (an absolute ``time.monotonic()`` value, or None for the
  store's own default); a store past its deadline answers TRANSIENT for the keys it did not
  finish, it does not hang and does not raise for them.

A storage hit is the leading run of keys whose ``get`` answered OK, never what ``exists`` said.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Protocol, cast, runtime_checkable

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.limits import MAX_DEADLINE, is_finite_number
from hicache.domain.pools import PoolName


class StoreStatus(enum.Enum):
    OK = "ok"  # done: the bytes were read or written whole
    MISS = "miss"  # get: the store does not hold this key
    # get: the store held a damaged copy (checksum mismatch, or another key's object) and
    # removed it; the caller treats it as a miss (recompute), a metric names it
    CORRUPT = "corrupt"
    FULL = "full"  # put: no room, even after the store's own eviction
    TRANSIENT = "transient"  # a timeout or a lost node: the same call may succeed later
    INVALID = "invalid"  # the request itself is wrong (sizes, key): retrying will not help
    FATAL = "fatal"  # the store is unusable (closed, misconfigured, master gone for good)

    @property
    def ok(self) -> bool:
        return self is StoreStatus.OK


_TOKEN = re.compile(r"^[0-9A-Za-z_.-]{1,128}$")
_HEX = re.compile(r"^[0-9a-f]{64}$")


def _check_token(_inst: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise ConfigError(
            f"store key {attribute.name} {value!r}: expected 1-128 characters of letters, "
            "digits, '_', '.' or '-'"
        )


def _check_hash(_inst: object, _attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not _HEX.match(value):
        raise ConfigError(
            f"store key page hash {value!r}: expected 64 lowercase hex digits (a sha256 digest)"
        )


@attrs.frozen
class StoreKey:
    """One stored object: ``pool``'s bytes of the page whose chained hash is ``page_hash``.

    ``namespace`` names what makes bytes incompatible (model, dtype, layout, page size, the
    pool's geometry, the rank where bytes differ per rank); ``str(key)`` is the object name.
    """

    namespace: str = attrs.field(validator=_check_token)
    pool: str = attrs.field(validator=_check_token)
    page_hash: str = attrs.field(validator=_check_hash)

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pool}/{self.page_hash}"


# One page of one pool in host memory: writable segments, read or written in order.
PageBuffer = Sequence[memoryview]


def buffer_nbytes(buffer: PageBuffer) -> int:
    """Total bytes of a page buffer's segments."""
    return sum(seg.nbytes for seg in buffer)


@attrs.frozen
class StoreHealth:
    """A snapshot of a store: whether it takes calls now, and why not."""

    healthy: bool
    detail: str = ""


@runtime_checkable
class Store(Protocol):
    """An L3 store of page objects. Synchronous and thread-safe; may block (never the loop)."""

    @property
    def name(self) -> str: ...

    def register(self, regions: Sequence[memoryview]) -> None:
        """Host memory that later ``get``/``put`` buffers lie in (once, before any transfer).

        Zero-copy stores register it with their transport; others may ignore it.
        """
        ...

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        """Whether each key is probably held: a hint, never proof of a hit."""
        ...

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        """Read each key's bytes into its buffer; OK only when every byte was read and checked.

        A key whose stored size differs from its buffer is INVALID (and nothing is written
        outside the buffer); a damaged object is CORRUPT (a miss the store could tell apart;
        a store that cannot tell answers MISS).
        """
        ...

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        """Write each buffer's bytes under its key; a reader never sees a torn object."""
        ...

    def remove(self, keys: Sequence[StoreKey]) -> list[StoreStatus]:
        """Forget each key (OK also when it was not held)."""
        ...

    def health(self) -> StoreHealth: ...

    def close(self) -> None:
        """Release connections and registrations; idempotent. Later calls answer FATAL."""
        ...


@runtime_checkable
class HostPageBuffers(Protocol):
    """The host page bytes of pool pages, as PageBuffers a Store reads into and writes from."""

    def buffer(self, pool: PoolName, page: int) -> PageBuffer:
        """The segments of page ``page`` of host pool ``pool`` (no copy); ForeignIndexError
        for a page outside the pool, ConfigError for a pool the group does not have."""
        ...


def _kind(value: object) -> str:
    return f"{type(value).__name__} {shown(value, 60)}"


def check_keys(keys: object) -> Sequence[StoreKey]:
    """``keys`` if it is a sequence of StoreKeys; ConfigError naming the first that is not."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise ConfigError(f"store keys must be a sequence of StoreKey, got {_kind(keys)}")
    if not all(type(k) is StoreKey for k in keys):
        for i, k in enumerate(keys):
            if not isinstance(k, StoreKey):
                raise ConfigError(f"store keys[{i}] must be a StoreKey, got {_kind(k)}")
    return keys


def check_deadline(deadline: object) -> float | None:
    """None or a finite number (absolute seconds, time.monotonic()); ConfigError otherwise."""
    if deadline is None:
        return None
    if not is_finite_number(deadline) or abs(cast(float, deadline)) > MAX_DEADLINE:
        raise ConfigError(
            f"store deadline must be None or a finite number (time.monotonic()) within "
            f"+-{MAX_DEADLINE:g}, got {_kind(deadline)}"
        )
    return float(cast(float, deadline))


def check_batch(keys: Sequence[StoreKey], buffers: object) -> None:
    """Raise ConfigError when a batch's keys are not StoreKeys, its buffers not sequences of
    memoryviews, or the two not paired 1:1."""
    check_keys(keys)
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Sequence):
        raise ConfigError(f"store buffers must be a sequence of page buffers, got {_kind(buffers)}")
    if len(keys) != len(buffers):
        raise ConfigError(f"store batch: {len(keys)} keys paired with {len(buffers)} buffers")
    # The container and its first segment: O(pages), not O(segments), on the read path (a
    # store still answers INVALID for a later segment it cannot use).
    for i, buf in enumerate(buffers):
        if type(buf) is not list and (  # the usual case, without the ABC check
            isinstance(buf, (str, bytes, bytearray, memoryview)) or not isinstance(buf, Sequence)
        ):
            raise ConfigError(
                f"store buffers[{i}] must be a sequence of memoryview segments, got {_kind(buf)}"
            )
        if buf and not isinstance(buf[0], memoryview):
            raise ConfigError(
                f"store buffers[{i}] holds {_kind(buf[0])}: segments must be memoryviews"
            )
