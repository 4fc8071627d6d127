"""The bytes of one page of an SGLang host pool, in ONE byte order whatever path moves them.

- PoolPages(name, pool): built once per registered SGLang host pool. ``segments(token)`` gives
  the page that starts at host token index ``token`` as writable memoryviews into the pool's own
  memory (zero-copy), ordered as SGLang's flat data page (``get_data_page(token, flat=True)``);
  ``flat_nbytes`` is that page's size.
- learn_order(...): the probe that finds that order (see below).

The stored byte order of a page is SGLang's FLAT page order, for every pool kind and layout.
SGLang hands a backend the same page in two orders: its flat page (legacy ``batch_set`` /
``batch_get`` and the v2 path of its file backend) and its zero-copy segments
(``get_page_buffer_meta``, used by v1 backends). For MHA ``layer_first`` they differ: the segments
alternate K and V per layer (k0, v0, k1, v1, ...) while the flat page is every K layer, then
every V layer (python/sglang/srt/mem_cache/pool_host/mha.py, ``get_page_buffer_meta`` and
``get_data_page``). A page written by one path and read by the other would come back scrambled,
so PoolPages reorders the zero-copy segments into the flat order (a permutation of views, no
copy) and every path reads and writes the same bytes in the same places.

The order is learnt, not hard-coded: at registration ``learn_order`` fills the segments of one
page with distinct random bytes, reads SGLang's flat page of it, finds each segment in it, and
restores the page's bytes. A pool whose segments are not a permutation of its flat page, whose
segment addresses are not one stride per page, or that has no zero-copy meta at all (SGLang's
Mamba pool in ``layer_first``, or with slot side states) is served through a copy: its flat page
(``get_data_page``) is put, and a get lands in a staging page that ``set_from_flat_data_page``
copies in only when it was read whole. Registration happens before SGLang serves (or on a
runtime attach, which SGLang requires to have no request in flight).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hicache.domain.errors import ConfigError, ForeignIndexError, shown


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as a flat writable memoryview (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ConfigError(
            f"a page tensor must be a contiguous CPU tensor, got device {tensor.device} "
            f"contiguous={tensor.is_contiguous()}"
        )
    flat = tensor.reshape(-1).view(torch.uint8)
    array: Any = flat.numpy()
    return memoryview(array).cast("B")


def _region(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _meta(pool: Any, token: int, page_size: int) -> tuple[list[int], list[int]]:
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(token, token + page_size))
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def learn_order(pool: Any, page_size: int, flat_nbytes: int) -> tuple[list[int], str]:
    """The order of page 0's zero-copy segments in SGLang's flat page (a permutation), or
    ([], why) when the pool has no zero-copy segments that tile its flat page."""
    try:
        ptrs, sizes = _meta(pool, 0, page_size)
    except (NotImplementedError, ValueError, AssertionError, AttributeError, TypeError) as e:
        return [], f"no zero-copy meta ({type(e).__name__}: {e})"
    if not ptrs or sum(sizes) != flat_nbytes or min(sizes) < 16:
        return [], f"segments of {sum(sizes)} bytes do not tile a flat page of {flat_nbytes}"
    views = [_region(p, s) for p, s in zip(ptrs, sizes, strict=True)]
    saved = [bytes(v) for v in views]
    try:
        tags = []
        for v in views:
            noise = os.urandom(v.nbytes)
            v[:] = noise
            tags.append(noise)
        flat = bytes(tensor_bytes(pool.get_data_page(0, flat=True).contiguous()))
    finally:
        for v, b in zip(views, saved, strict=True):
            v[:] = b
    by_prefix = {t[:16]: j for j, t in enumerate(tags)}
    order: list[int] = []
    offset = 0
    while offset < len(flat):
        j = by_prefix.get(flat[offset : offset + 16])
        if j is None or j in order or flat[offset : offset + sizes[j]] != tags[j]:
            return [], f"segment order does not match the flat page at byte {offset}"
        order.append(j)
        offset += sizes[j]
    return order, ""


class PoolPages:
    """Zero-copy (or staged) page buffers of one SGLang host pool, in its flat page order."""

    def __init__(self, name: str, pool: Any) -> None:
        self.name = name
        self.pool = pool
        self.page_size = int(pool.page_size)
        dummy = pool.get_dummy_flat_data_page()
        self.flat_nbytes = int(dummy.numel() * dummy.element_size())
        self.pages = int(pool.size) // self.page_size
        self.layout = str(getattr(pool, "layout", ""))
        order, why = learn_order(pool, self.page_size, self.flat_nbytes)
        self._bases: list[memoryview] = []
        self._strides: list[int] = []
        self._sizes: list[int] = []
        self.copy_reason = why
        if order:
            self._affine(order)

    def _affine(self, order: Sequence[int]) -> None:
        p0, s0 = _meta(self.pool, 0, self.page_size)
        last = self.pages - 1
        if last == 0:
            strides = [0] * len(p0)
        else:
            p1, _ = _meta(self.pool, self.page_size, self.page_size)
            pl, sl = _meta(self.pool, last * self.page_size, self.page_size)
            strides = [b - a for a, b in zip(p0, p1, strict=True)]
            if sl != s0 or any(
                a + last * st != z for a, st, z in zip(p0, strides, pl, strict=True)
            ):
                self.copy_reason = "segment addresses are not one stride per page"
                return
        for j in order:
            span = strides[j] * last + s0[j]
            self._bases.append(_region(p0[j], span))
            self._strides.append(strides[j])
            self._sizes.append(s0[j])
        self.copy_reason = ""

    def regions(self) -> list[memoryview]:
        """The pool memory its zero-copy segments lie in, as disjoint byte ranges (what a
        zero-copy store such as Mooncake registers once)."""
        spans = sorted((_address(b), _address(b) + b.nbytes) for b in self._bases)
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [_region(start, end - start) for start, end in merged]

    @property
    def zero_copy(self) -> bool:
        return bool(self._bases)

    def page_of(self, token: int) -> int:
        """The page that starts at host token index ``token``; ForeignIndexError otherwise."""
        if token % self.page_size or not 0 <= token < self.pages * self.page_size:
            raise ForeignIndexError(
                f"sglang pool {shown(self.name)}: host index {token} does not start one of its "
                f"{self.pages} pages of {self.page_size} tokens"
            )
        return token // self.page_size

    def segments(self, token: int) -> list[memoryview]:
        """The page's bytes in the pool's memory, in flat order (zero-copy pools only)."""
        page = self.page_of(token)
        return [
            base[page * st : page * st + size]
            for base, st, size in zip(self._bases, self._strides, self._sizes, strict=True)
        ]

    def flat_copy(self, token: int) -> memoryview:
        """A copy of the page's flat bytes (what a staged put writes)."""
        self.page_of(token)
        page = self.pool.get_data_page(token, flat=True).contiguous()
        return tensor_bytes(page)

    def staging(self) -> torch.Tensor:
        """A fresh flat page for a staged get (SGLang's own dummy page)."""
        page: torch.Tensor = self.pool.get_dummy_flat_data_page()
        return page

    def fill_from(self, token: int, page: torch.Tensor) -> None:
        """Copy a staged page into the pool (after it was read whole)."""
        self.page_of(token)
        self.pool.set_from_flat_data_page(token, page)

    def describe(self) -> str:
        """What makes this pool's bytes incompatible with another's (for the namespace)."""
        dtypes = sorted({str(t.dtype) for t in _tensors(self.pool)}) or [
            str(getattr(self.pool, "dtype", ""))
        ]
        return (
            f"class={type(self.pool).__name__}|layout={self.layout}|page={self.page_size}"
            f"|page_bytes={self.flat_nbytes}|dtypes={','.join(dtypes)}"
            f"|layers={getattr(self.pool, 'start_layer', '')}-{getattr(self.pool, 'end_layer', '')}"
            f":{getattr(self.pool, 'layer_num', '')}"
        )


def _tensors(pool: Any) -> list[torch.Tensor]:
    found = getattr(pool, "kv_buffer", None)
    items = found if isinstance(found, list | tuple) else [found]
    return [t for t in items if isinstance(t, torch.Tensor)]


def equal_pages(a: memoryview, b: memoryview) -> bool:
    """Byte equality of two flat pages (tests and the bench)."""
    return bool(np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)))
