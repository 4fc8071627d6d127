"""`hicache bench sglang`: SGLang's HiCacheFile and hicache's backend over one SGLang host pool.

- SglangBench: the geometry (pages, page size, layers, heads, head dim, layout), rounds, root.
- run_sglang_bench(bench): the figures (schema in hicache.cli.bench_sglang).

Both backends move the pages of ONE SGLang ``MHATokenToKVPoolHost`` (bf16, pinning off), each
through the calls SGLang's controller makes for it (python/sglang/srt/managers/cache_controller.py):
hicache's backend (store ``directory``, checksums on) through the zero-copy v1 calls that
``interface_v1`` selects (``batch_set_v1`` / ``batch_get_v1`` of host indices); ``HiCacheFile``
(python/sglang/srt/mem_cache/hicache_storage.py), which has no v1 calls, through the legacy
calls SGLang uses for it (``_generic_page_set``: ``get_data_page`` per page then ``batch_set``;
``_generic_page_get``: ``batch_get`` into dummy flat pages then ``set_from_flat_data_page``).
Each round puts every page from the first half of the pool under fresh keys, probes
``batch_exists`` (repeated), and gets every page into the second half; each get is checked
byte-exact. One warm-up round is not counted; the backends alternate which goes first; medians
are reported. Both write to the same file system (page cache warm, no fsync on either side).

Corruption: after the rounds, one byte in the payload of one stored page is flipped on disk for
each backend and that page is read back; ``corruption_detected`` is whether the backend answered
a miss (hicache) or None (HiCacheFile) instead of returning the damaged bytes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

from hicache.bootstrap.faults import directory_corruptor
from hicache.domain.errors import ConfigError, StoreError
from hicache.integrations.sglang.backend import HiCacheBackend
from hicache.integrations.sglang.keys import page_key

EXISTS_PROBES = 2000


@attrs.frozen(kw_only=True)
class SglangBench:
    pages: int = 64
    page_size: int = 64
    layers: int = 32
    heads: int = 8
    head_dim: int = 64
    layout: str = "page_first_direct"
    repeats: int = 5
    root: Path | None = None


class BenchError(StoreError):
    """A backend returned wrong bytes or failed a page during the bench."""


def host_pool(bench: SglangBench) -> Any:
    """SGLang's MHA host pool of ``2 x pages`` pages over small device-side CPU tensors."""
    dtype = torch.bfloat16
    dev = bench.page_size
    k = tuple(
        torch.zeros(dev, bench.heads, bench.head_dim, dtype=dtype) for _ in range(bench.layers)
    )
    v = tuple(
        torch.zeros(dev, bench.heads, bench.head_dim, dtype=dtype) for _ in range(bench.layers)
    )

    def ptrs(ts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)

    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v), layout=KVBufferLayout.NHD
        ),
        page_size=bench.page_size,
        head_num=bench.heads,
        head_dim=bench.head_dim,
        v_head_dim=bench.head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        1.0,
        0,
        bench.page_size,
        bench.layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=dev,
        start_layer=0,
        end_layer=bench.layers,
        host_token_capacity=2 * bench.pages * bench.page_size,
    )


def _config(extra: dict[str, Any] | None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="hicache-bench",
        extra_config=extra,
    )


def _page(pool: Any, page: int) -> bytes:
    flat = pool.get_data_page(page * pool.page_size, flat=True).contiguous()
    return bytes(flat.reshape(-1).view(torch.uint8).numpy())


class _Side:
    """One backend, its put / get / exists over the pool, and its on-disk page corruptor."""

    def __init__(
        self,
        name: str,
        put: Callable[[list[str]], bool],
        get: Callable[[list[str]], list[bool]],
        exists: Callable[[list[str]], int],
        corrupt: Callable[[str], bool],
    ) -> None:
        self.name, self.put, self.get, self.exists, self.corrupt = name, put, get, exists, corrupt
        self.detail: Callable[[], str] = lambda: "no detail"
        self.put_s: list[float] = []
        self.get_s: list[float] = []
        self.exists_s: list[float] = []
        self.pages_put = 0  # measured rounds only, each page byte-checked after its get
        self.pages_got = 0


def _hicache_side(
    pool: Any, root: Path, src: torch.Tensor, dst: torch.Tensor
) -> tuple[_Side, HiCacheBackend]:
    backend = HiCacheBackend(
        _config({"interface_v1": 1, "store": "directory", "store_path": str(root)}), {}
    )
    backend.register_mem_pool_host(pool)
    corruptor = directory_corruptor(root)

    def corrupt(key: str) -> bool:
        return corruptor(backend.pool("kv").tier.store_keys(page_key(key))[0])

    ps = pool.page_size
    side = _Side(
        "hicache",
        lambda keys: all(backend.batch_set_v1(keys, src[: len(keys) * ps])),
        lambda keys: backend.batch_get_v1(keys, dst[: len(keys) * ps]),
        backend.batch_exists,
        corrupt,
    )
    side.detail = lambda: str(backend.statistics())
    return side, backend


def _file_side(pool: Any, root: Path, bench: SglangBench) -> tuple[_Side, HiCacheFile]:
    backend = HiCacheFile(_config({}), file_path=str(root))
    backend.register_mem_pool_host(pool)
    ps = bench.page_size

    def put(keys: list[str]) -> bool:  # SGLang's _generic_page_set
        data = [pool.get_data_page(i * ps) for i in range(len(keys))]
        return bool(backend.batch_set(keys, data))

    def get(keys: list[str]) -> list[bool]:  # SGLang's _generic_page_get
        dummy = [pool.get_dummy_flat_data_page() for _ in keys]
        pages = backend.batch_get(keys, dummy)
        ok = []
        for i, page in enumerate(pages):
            if page is None:
                ok.append(False)
                continue
            pool.set_from_flat_data_page((bench.pages + i) * ps, page)
            ok.append(True)
        return ok

    def corrupt(key: str) -> bool:
        path = Path(backend.file_path) / f"{backend._get_suffixed_key(key)}.bin"
        try:
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                byte = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([byte[0] ^ 0xFF]))
        except OSError:
            return False
        return True

    return _Side("hicache_file", put, get, backend.batch_exists, corrupt), backend


def _round(side: _Side, pool: Any, bench: SglangBench, tag: str, expected: list[bytes]) -> None:
    keys = [page_key(f"{side.name}-{tag}-{i}").hex() for i in range(bench.pages)]
    start = time.perf_counter()
    if not side.put(keys):
        raise BenchError(f"bench sglang: {side.name} failed a put ({side.detail()})")
    side.put_s.append(time.perf_counter() - start)
    loops = max(1, EXISTS_PROBES // bench.pages)
    start = time.perf_counter()
    for _ in range(loops):
        found = side.exists(keys)
    side.exists_s.append((time.perf_counter() - start) / (loops * bench.pages))
    if found != bench.pages:
        raise BenchError(f"bench sglang: {side.name} found {found} of {bench.pages} pages")
    start = time.perf_counter()
    ok = side.get(keys)
    side.get_s.append(time.perf_counter() - start)
    got = [_page(pool, bench.pages + i) for i in range(bench.pages)]
    if not all(ok) or got != expected:
        raise BenchError(
            f"bench sglang: {side.name} returned wrong or missing pages ({side.detail()})"
        )
    side.pages_put += len(keys)
    side.pages_got += sum(ok)


def _detects_corruption(side: _Side, bench: SglangBench) -> bool:
    keys = [page_key(f"{side.name}-damaged-{i}").hex() for i in range(1)]
    if not side.put(keys) or not side.corrupt(keys[0]):
        raise BenchError(f"bench sglang: could not damage a page of {side.name}")
    return not side.get(keys)[0]


def run_sglang_bench(bench: SglangBench) -> dict[str, Any]:
    if bench.pages < 1 or bench.repeats < 1:
        raise ConfigError(f"bench sglang: pages and repeats must be >= 1, got {bench}")
    page = 2 * bench.layers * bench.page_size * bench.heads * bench.head_dim * 2
    need = 2 * bench.pages * page
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > ram // 2:
        raise ConfigError(
            f"bench sglang: --pages {bench.pages} of {page} bytes needs a host pool of {need} "
            f"bytes (two halves): expected at most half of this machine's {ram} bytes of memory"
        )
    pool = host_pool(bench)
    ps = bench.page_size
    flat = pool.kv_buffer.view(-1).view(torch.uint8)
    flat.copy_(
        torch.randint(
            0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
    )
    expected = [_page(pool, i) for i in range(bench.pages)]
    src = torch.arange(0, bench.pages * ps, dtype=torch.int64)
    dst = torch.arange(bench.pages * ps, 2 * bench.pages * ps, dtype=torch.int64)
    with tempfile.TemporaryDirectory(dir=bench.root) as tmp:
        hi, hi_backend = _hicache_side(pool, Path(tmp) / "hicache", src, dst)
        hf, _hf_backend = _file_side(pool, Path(tmp) / "hicache_file", bench)
        try:
            for r in range(bench.repeats + 1):
                order = (hi, hf) if r % 2 == 0 else (hf, hi)
                for side in order:
                    _round(side, pool, bench, str(r), expected)
                if r == 0:  # warm-up
                    for side in (hi, hf):
                        side.put_s.clear()
                        side.get_s.clear()
                        side.exists_s.clear()
                        side.pages_put = side.pages_got = 0
            detected = {s.name: _detects_corruption(s, bench) for s in (hi, hf)}
            page_bytes = len(expected[0])
            total = page_bytes * bench.pages

            def figures(side: _Side) -> dict[str, float]:
                return {
                    "put_gbps": float(f"{total / statistics.median(side.put_s) / 1e9:.4g}"),
                    "get_gbps": float(f"{total / statistics.median(side.get_s) / 1e9:.4g}"),
                    "exists_per_s": round(1 / statistics.median(side.exists_s)),
                    "pages_put": side.pages_put,
                    "pages_got": side.pages_got,
                }

            def ratio(op: str) -> float:  # hicache over HiCacheFile, same run's medians
                mine = statistics.median(getattr(hi, f"{op}_s"))
                theirs = statistics.median(getattr(hf, f"{op}_s"))
                return float(f"{theirs / mine:.4g}")

            stats = hi_backend.statistics()["pools"]["kv"]
            return {
                "pages": bench.pages,
                "page_bytes": page_bytes,
                "hicache": figures(hi),
                "hicache_file": figures(hf),
                "ratios": {"put": ratio("put"), "get": ratio("get")},
                # every page hicache's store wrote, warm-up and the damaged page included
                "hicache_store_pages_written": stats["tier"]["pages_written_ok"],
                "corruption_detected": detected,
                "layout": bench.layout,
                "repeats": bench.repeats,
                "zero_copy": stats["zero_copy"],
                "paths": {"hicache": "v1 zero-copy", "hicache_file": "legacy flat pages"},
            }
        finally:
            hi_backend.close()
