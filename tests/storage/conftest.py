"""Storage test helpers: keys, page buffers of random bytes, and a store per implementation.

- key(i, namespace, pool): a StoreKey whose page hash is sha256 of ``i``.
- page(nbytes, seed) / empty(nbytes): a one-segment PageBuffer of random / zero bytes.
- joined(buffer): a PageBuffer's bytes.
"""

from __future__ import annotations

import hashlib
import random

from hicache.domain.storage import PageBuffer, StoreKey


def key(i: int, namespace: str = "ns", pool: str = "kv") -> StoreKey:
    return StoreKey(namespace, pool, hashlib.sha256(str(i).encode()).hexdigest())


def page(nbytes: int, seed: int = 0) -> list[memoryview]:
    return [memoryview(bytearray(random.Random(seed).randbytes(nbytes)))]


def empty(nbytes: int) -> list[memoryview]:
    return [memoryview(bytearray(nbytes))]


def joined(buffer: PageBuffer) -> bytes:
    return b"".join(bytes(seg) for seg in buffer)
