"""Host memory adapters: exact sizes, zero-copy views, pre-faulting, pinning rules, store port."""

from __future__ import annotations

import ctypes
import errno
import itertools
import math
import mmap
import os
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hicache.adapters.host_memory import (
    AnonymousRegion,
    HostRegion,
    PinnedRegion,
    ShmRegion,
    StoreRegion,
    open_region,
    register_store_provider,
    should_pin,
    store_provider,
    unregister_store_provider,
)
from hicache.adapters.host_memory.anonymous import MADV_POPULATE_READ, MADV_POPULATE_WRITE, prefault
from hicache.adapters.host_memory.pinned import MAX_CHUNK_BYTES, plan_chunks
from hicache.domain import (
    ConfigError,
    HostMemory,
    HostMemoryError,
    MemoryKind,
    PinnedMemoryError,
    Pinning,
)
from tests.adapters.conftest import PAGE, resident_pages, rss_bytes

MiB = 1 << 20
ANON = MemoryKind("anonymous")
SHM = MemoryKind("shm")
MOONCAKE = MemoryKind("store:mooncake")
HAS_GPU = torch.cuda.is_available()
no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour of a machine without a GPU")


def read_raw(address: int, n: int) -> bytes:
    """The bytes at ``address`` read through ctypes: a view independent of torch."""
    return ctypes.string_at(address, n)


# --- anonymous ---------------------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [1, PAGE - 1, PAGE, PAGE + 1, 3 * MiB + 12345])
def test_anonymous_region_has_exactly_the_size_asked(nbytes: int) -> None:
    with AnonymousRegion.allocate(nbytes) as region:
        t = region.tensor()
        assert region.nbytes == nbytes
        assert t.dtype == torch.uint8
        assert t.shape == (nbytes,)
        assert t.device.type == "cpu"
        assert int(t.data_ptr()) == region.address
        assert region.kind == ANON
        assert not region.pinned


def test_anonymous_tensor_is_a_view_of_the_mapping_not_a_copy() -> None:
    with AnonymousRegion.allocate(64 * 1024) as region:
        region.tensor()[100:104] = torch.tensor([1, 2, 3, 250], dtype=torch.uint8)
        assert read_raw(region.address + 100, 4) == bytes([1, 2, 3, 250])
        ctypes.memset(region.address + 5000, 9, 10)  # write behind torch's back
        assert region.tensor()[5000:5010].tolist() == [9] * 10
        assert region.tensor().data_ptr() == region.tensor().data_ptr()


def test_anonymous_region_is_zeroed_and_every_page_is_resident_before_first_use() -> None:
    with AnonymousRegion.allocate(4 * MiB + 100) as region:
        present, pages = resident_pages(region.address, region.nbytes)
        assert present == pages
        assert region.prefault_method in ("populate", "touch")
        assert int(region.tensor().count_nonzero()) == 0


@pytest.mark.parametrize("huge_pages", [False, True])
def test_anonymous_resident_memory_is_at_most_1_01x_of_what_was_asked(huge_pages: bool) -> None:
    nbytes = 48 * MiB + 4321  # not a power of two: an allocator that rounds up would show
    before = rss_bytes("RssAnon")
    region = AnonymousRegion.allocate(nbytes, huge_pages=huge_pages)
    try:
        grown = rss_bytes("RssAnon") - before
        assert grown <= 1.01 * nbytes, f"RSS grew {grown} B for {nbytes} B"
        assert grown >= 0.99 * nbytes, f"only {grown} B of {nbytes} B were faulted in"
    finally:
        region.close()


def test_closing_an_anonymous_region_returns_its_memory() -> None:
    region = AnonymousRegion.allocate(32 * MiB)
    before = rss_bytes("RssAnon")
    region.close()
    assert before - rss_bytes("RssAnon") >= 31 * MiB


def test_close_is_idempotent_and_a_closed_region_refuses_use() -> None:
    region = AnonymousRegion.allocate(PAGE)
    with region as entered:
        assert entered is region
        assert not region.closed
    assert region.closed
    region.close()
    assert region.closed
    with pytest.raises(HostMemoryError, match="closed"):
        region.tensor()
    with pytest.raises(HostMemoryError, match="closed"):
        _ = region.address
    assert "closed" in repr(region)


def test_a_view_that_outlives_close_no_longer_holds_the_memory() -> None:
    # Deliberate change (issue 8): close gives the pages back at once; the range stays reserved
    # (nothing else is mapped there) until the last view goes, and using such a view faults
    # (tests/adapters/test_release_on_close.py).
    region = AnonymousRegion.allocate(16 * PAGE)
    view = region.tensor()[PAGE:]
    view.fill_(5)
    before = rss_bytes("RssAnon")
    region.close()
    assert before - rss_bytes("RssAnon") >= 15 * PAGE
    del view


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4096", None])
def test_bad_sizes_are_config_errors_naming_the_value(bad: Any) -> None:
    with pytest.raises(ConfigError, match="positive integer") as info:
        AnonymousRegion.allocate(bad)
    assert repr(bad) in str(info.value)
    with pytest.raises(ConfigError, match="positive integer"):
        open_region(HostMemory(ANON), bad)


def test_huge_pages_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="huge_pages"):
        AnonymousRegion.allocate(PAGE, huge_pages="yes")  # type: ignore[arg-type]


def test_prefault_without_writing_keeps_the_bytes() -> None:
    m = mmap.mmap(-1, 4 * PAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t[PAGE + 3] = 42
    assert prefault(m, t, write=False) in ("populate", "touch")
    assert int(t[PAGE + 3]) == 42
    del t
    m.close()


# --- open_region and the pinning policy ---------------------------------------------------------


@pytest.mark.parametrize("pinning", [Pinning.OFF, Pinning.AUTO])
def test_open_region_anonymous_on_cpu_is_unpinned(pinning: Pinning) -> None:
    with open_region(HostMemory(ANON, pinning), 10_000) as region:
        assert isinstance(region, AnonymousRegion)
        assert not region.pinned
        assert region.nbytes == 10_000


def test_open_region_keeps_the_original_call_shape() -> None:
    with open_region(HostMemory(ANON), 4096, device="cpu") as region:
        assert region.nbytes == 4096


def test_open_region_shm_gives_a_named_segment() -> None:
    with open_region(HostMemory(SHM, Pinning.OFF), 3 * PAGE) as region:
        assert isinstance(region, ShmRegion)
        assert region.shm_name is not None
        assert os.path.exists(f"/dev/shm/{region.shm_name}")
    assert not os.path.exists(f"/dev/shm/{region.shm_name}")


@no_gpu
@pytest.mark.parametrize("kind", [ANON, SHM])
def test_pinned_on_without_a_gpu_is_a_clear_error_and_maps_nothing(kind: MemoryKind) -> None:
    before = rss_bytes("RssAnon") + rss_bytes("RssShmem")
    with pytest.raises(PinnedMemoryError, match=r"no CUDA or ROCm GPU.*pinned=auto"):
        open_region(HostMemory(kind, Pinning.ON), 16 * MiB, device="cuda")
    assert rss_bytes("RssAnon") + rss_bytes("RssShmem") - before < 4 * MiB


@no_gpu
@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "rocm"])
def test_pinned_auto_without_a_gpu_gives_pageable_memory(device: str) -> None:
    assert not should_pin(Pinning.AUTO, device)
    with open_region(HostMemory(ANON, Pinning.AUTO), PAGE, device=device) as region:
        assert not region.pinned
        assert not region.tensor().is_pinned()


def test_pinned_auto_never_pins_for_a_cpu_device() -> None:
    assert not should_pin(Pinning.AUTO, "cpu")
    assert not should_pin(Pinning.OFF, "cuda")


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "CUDA", "", "cpu:0:1"])
def test_unknown_device_is_a_config_error(device: str) -> None:
    with pytest.raises(ConfigError, match="unknown device"):
        open_region(HostMemory(ANON), PAGE, device=device)


def test_row_bytes_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="row_bytes"):
        open_region(HostMemory(ANON), PAGE, row_bytes=0)


def test_huge_pages_are_refused_for_kinds_that_cannot_honour_them() -> None:
    with pytest.raises(ConfigError, match="huge_pages applies to anonymous"):
        open_region(HostMemory(SHM), PAGE, huge_pages=True)


def test_open_region_anonymous_with_huge_pages() -> None:
    with open_region(HostMemory(ANON), 4 * MiB, huge_pages=True) as region:
        assert isinstance(region, AnonymousRegion)
        assert region.huge_pages


# --- pinning with a fake driver (the chunking and rollback logic) -------------------------------


class FakeRegistrar:
    """A driver stand-in: records registered ranges; can fail one register or unregister call."""

    def __init__(self, fail_register_at: int | None = None, fail_unregister: bool = False):
        self.registered: dict[int, int] = {}
        self.calls = 0
        self.fail_register_at = fail_register_at
        self.fail_unregister = fail_unregister

    def register(self, address: int, nbytes: int) -> int:
        index, self.calls = self.calls, self.calls + 1
        if index == self.fail_register_at:
            return 2  # cudaErrorMemoryAllocation
        if any(a < address + nbytes and address < a + n for a, n in self.registered.items()):
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[address] = nbytes
        return 0

    def unregister(self, address: int) -> int:
        if self.fail_unregister:
            return 713
        return 0 if self.registered.pop(address, None) is not None else 713

    def error_string(self, code: int) -> str:
        return {2: "out of memory", 712: "already registered"}.get(code, "not registered")


def test_chunks_cover_the_region_and_split_only_at_whole_rows_and_pages() -> None:
    row = 3000  # a page row that is not a multiple of the page size
    assert len(plan_chunks(10 * MiB + 7, row_bytes=row, chunk_bytes=4 * MiB)) == 4
    chunks = plan_chunks(10 * MiB + 7, row_bytes=row, chunk_bytes=4 * MiB)
    assert chunks[0][0] == 0
    assert sum(size for _, size in chunks) == 10 * MiB + 7
    for (off, size), (next_off, _) in itertools.pairwise(chunks):
        assert off + size == next_off
        assert next_off % row == 0
        assert next_off % PAGE == 0
        assert size <= 4 * MiB
    assert plan_chunks(100, row_bytes=64) == [(0, 100)]
    assert plan_chunks(3 * MAX_CHUNK_BYTES, row_bytes=PAGE)[1] == (MAX_CHUNK_BYTES, MAX_CHUNK_BYTES)


@given(
    row_bytes=st.integers(1, 1 << 20),
    chunk_pages=st.integers(1, 1 << 12),
    fill=st.floats(0.0, 40.0),
)
def test_chunk_plan_invariants(row_bytes: int, chunk_pages: int, fill: float) -> None:
    chunk_bytes = chunk_pages * PAGE
    nbytes = max(1, int(fill * chunk_bytes))
    try:
        chunks = plan_chunks(nbytes, row_bytes=row_bytes, chunk_bytes=chunk_bytes)
    except ConfigError:
        assert nbytes > chunk_bytes
        assert math.lcm(row_bytes, PAGE) > chunk_bytes
        return
    assert chunks[0][0] == 0
    assert sum(size for _, size in chunks) == nbytes
    assert all(0 < size <= chunk_bytes for _, size in chunks)
    for (off, size), (next_off, _) in itertools.pairwise(chunks):
        assert off + size == next_off
        assert next_off % row_bytes == 0
        assert next_off % PAGE == 0


def test_a_row_larger_than_a_chunk_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=f"row_bytes={2 * PAGE}"):
        plan_chunks(10 * PAGE, row_bytes=2 * PAGE, chunk_bytes=PAGE)


def test_a_region_that_fits_one_chunk_needs_no_alignment() -> None:
    odd_row = 1_000_000_007  # lcm with the page size is far above any chunk size
    assert plan_chunks(3 * odd_row, row_bytes=odd_row) == [(0, 3 * odd_row)]


def test_pinned_region_registers_every_chunk_and_unregisters_on_close() -> None:
    fake = FakeRegistrar()
    region = PinnedRegion.wrap(
        AnonymousRegion.allocate(10 * PAGE + 1),
        row_bytes=PAGE,
        chunk_bytes=3 * PAGE,
        registrar=fake,
    )
    assert region.pinned
    assert region.kind == ANON
    assert region.nbytes == 10 * PAGE + 1
    assert len(region.chunks) == 4
    assert sorted(fake.registered) == [region.address + off for off, _ in region.chunks]
    region.tensor()[:3] = 1
    assert read_raw(region.address, 3) == b"\x01\x01\x01"
    inner = region.inner
    region.close()
    region.close()
    assert fake.registered == {}
    assert region.closed
    assert not region.pinned
    assert inner.closed


def test_a_failed_chunk_unregisters_the_others_and_names_the_chunk() -> None:
    fake = FakeRegistrar(fail_register_at=2)
    inner = AnonymousRegion.allocate(8 * PAGE)
    with pytest.raises(PinnedMemoryError) as info:
        PinnedRegion.wrap(inner, row_bytes=PAGE, chunk_bytes=2 * PAGE, registrar=fake)
    message = str(info.value)
    assert "chunk 2 of 4" in message
    assert f"offset {4 * PAGE}" in message
    assert f"{2 * PAGE} B" in message
    assert "out of memory (error 2)" in message
    assert "2 chunk(s) before it were unregistered" in message
    assert fake.registered == {}
    assert not inner.closed  # still the caller's
    inner.close()


def test_pinning_twice_is_refused_and_leaves_the_first_registration() -> None:
    fake = FakeRegistrar()
    inner = AnonymousRegion.allocate(4 * PAGE)
    pinned = PinnedRegion.wrap(inner, registrar=fake)
    with pytest.raises(PinnedMemoryError, match="already pinned"):
        PinnedRegion.wrap(pinned, registrar=fake)
    # The driver refuses a second registration of the same range, and that is reported too.
    with pytest.raises(PinnedMemoryError, match=r"already registered \(error 712\)"):
        PinnedRegion.wrap(inner, registrar=fake)
    assert len(fake.registered) == 1
    pinned.close()
    assert fake.registered == {}


def test_unwrap_unpins_and_hands_the_region_back() -> None:
    fake = FakeRegistrar()
    pinned = PinnedRegion.wrap(AnonymousRegion.allocate(PAGE), registrar=fake)
    inner = pinned.unwrap()
    assert fake.registered == {}
    assert pinned.closed
    assert not inner.closed
    inner.close()


def test_a_failed_unregister_is_reported_and_the_region_is_still_closed() -> None:
    fake = FakeRegistrar()
    pinned = PinnedRegion.wrap(AnonymousRegion.allocate(PAGE), registrar=fake)
    inner = pinned.inner
    fake.fail_unregister = True
    with pytest.raises(PinnedMemoryError, match="cudaHostUnregister failed"):
        pinned.close()
    assert pinned.closed
    assert inner.closed
    pinned.close()  # idempotent, does not raise again


def test_pinning_wraps_a_shared_memory_region() -> None:
    fake = FakeRegistrar()
    pinned = PinnedRegion.wrap(ShmRegion.create(2 * PAGE), registrar=fake)
    name = pinned.shm_name
    assert name is not None
    assert pinned.kind == SHM
    assert os.path.exists(f"/dev/shm/{name}")
    pinned.close()
    assert fake.registered == {}
    assert not os.path.exists(f"/dev/shm/{name}")


@no_gpu
def test_wrap_without_a_gpu_and_without_a_registrar_is_a_pinned_memory_error() -> None:
    with AnonymousRegion.allocate(PAGE) as inner:
        with pytest.raises(PinnedMemoryError, match="no CUDA or ROCm GPU"):
            PinnedRegion.wrap(inner)
        assert not inner.closed


# --- the store-owned port -----------------------------------------------------------------------


class FakeStoreProvider:
    """A store that owns its memory: hands out slices of one arena and counts them back."""

    def __init__(self, arena_bytes: int = 1 * MiB, slack: int = 0) -> None:
        self.arena = AnonymousRegion.allocate(arena_bytes)
        self.slack = slack
        self.next = 0
        self.outstanding: set[int] = set()

    def allocate(self, nbytes: int) -> HostRegion:
        if self.next + nbytes + self.slack > self.arena.nbytes:
            raise MemoryError("arena exhausted")
        # A view of the arena: the store keeps owning the memory.
        buffer = _Slice(self.arena, self.next, nbytes + self.slack)
        self.next += nbytes + self.slack
        self.outstanding.add(buffer.address)
        return buffer

    def release(self, buffer: Any) -> None:
        self.outstanding.remove(buffer.address)


class _Slice(HostRegion):
    def __init__(self, arena: AnonymousRegion, offset: int, nbytes: int) -> None:
        self.kind = MOONCAKE
        self.nbytes = nbytes
        self._view = arena.tensor()[offset : offset + nbytes]

    @property
    def address(self) -> int:
        return int(self._view.data_ptr())

    @property
    def pinned(self) -> bool:
        return False

    def tensor(self) -> torch.Tensor:
        return self._view

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        pass


@pytest.fixture
def fake_mooncake() -> Any:
    provider = FakeStoreProvider(slack=100)
    register_store_provider("mooncake", provider)
    try:
        yield provider
    finally:
        unregister_store_provider("mooncake")
        provider.arena.close()


def test_store_kind_without_a_provider_says_which_store_and_what_to_do() -> None:
    with pytest.raises(HostMemoryError) as info:
        open_region(HostMemory(MOONCAKE), PAGE)
    message = str(info.value)
    assert "'mooncake'" in message
    assert "register_store_provider" in message


def test_store_region_wraps_what_the_provider_hands_over(fake_mooncake: FakeStoreProvider) -> None:
    assert store_provider("mooncake") is fake_mooncake
    region = open_region(HostMemory(MOONCAKE, Pinning.AUTO), 1000)
    assert isinstance(region, StoreRegion)
    assert region.kind == MOONCAKE
    assert region.nbytes == 1000  # exactly what was asked, though the store handed over more
    assert region.tensor().shape == (1000,)
    region.tensor()[:4] = 7
    assert fake_mooncake.arena.tensor()[:4].tolist() == [7] * 4  # zero copy into store memory
    assert len(fake_mooncake.outstanding) == 1
    region.close()
    region.close()
    assert fake_mooncake.outstanding == set()
    with pytest.raises(HostMemoryError, match="closed"):
        region.tensor()


def test_store_failures_are_host_memory_errors(fake_mooncake: FakeStoreProvider) -> None:
    with pytest.raises(HostMemoryError, match=r"store 'mooncake' could not hand over.*exhausted"):
        open_region(HostMemory(MOONCAKE), 2 * MiB)


def test_a_buffer_smaller_than_asked_is_refused_and_given_back() -> None:
    class Short(FakeStoreProvider):
        def allocate(self, nbytes: int) -> HostRegion:
            return super().allocate(nbytes // 2)

    provider = Short()
    register_store_provider("mooncake", provider)
    try:
        with pytest.raises(HostMemoryError, match="fewer than the 4096 B asked for"):
            StoreRegion.allocate("mooncake", 4096)
        assert provider.outstanding == set()
    finally:
        unregister_store_provider("mooncake")
        provider.arena.close()


def test_provider_registry_rules(fake_mooncake: FakeStoreProvider) -> None:
    register_store_provider("mooncake", fake_mooncake)  # the same one again: fine
    with pytest.raises(ConfigError, match="already has a host memory provider"):
        register_store_provider("mooncake", FakeStoreProvider(arena_bytes=PAGE))
    with pytest.raises(ConfigError, match="unknown host memory kind 'store:redis'"):
        register_store_provider("redis", fake_mooncake)
    assert unregister_store_provider("mooncake")
    assert not unregister_store_provider("mooncake")


def test_pinning_wraps_a_store_region(fake_mooncake: FakeStoreProvider) -> None:
    fake = FakeRegistrar()
    pinned = PinnedRegion.wrap(StoreRegion.allocate("mooncake", 2 * PAGE), registrar=fake)
    assert pinned.kind == MOONCAKE
    assert len(fake.registered) == 1
    pinned.close()
    assert fake.registered == {}
    assert fake_mooncake.outstanding == set()


# --- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [ANON, SHM])
def test_gpu_pinned_region_is_registered_and_copies_byte_exact(kind: MemoryKind) -> None:
    n = 8 * MiB + 4096
    region = open_region(HostMemory(kind, Pinning.ON), n, device="cuda", row_bytes=4096)
    try:
        assert isinstance(region, PinnedRegion)
        assert region.pinned
        host = region.tensor()
        assert host.is_pinned()  # cudaPointerGetAttributes reports host-registered memory
        assert host[n - 1 :].is_pinned()
        pattern = torch.randint(0, 256, (n,), dtype=torch.uint8)
        host.copy_(pattern)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev.copy_(host, non_blocking=True)  # cudaMemcpyAsync from registered memory
        torch.cuda.synchronize()  # the copy reads host asynchronously: zero it only after
        host.zero_()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host, pattern)
    finally:
        region.close()


@pytest.mark.gpu
def test_gpu_pinned_auto_pins_for_a_cuda_device_only() -> None:
    with open_region(HostMemory(ANON, Pinning.AUTO), MiB, device="cuda") as region:
        assert region.pinned
        assert region.tensor().is_pinned()
    with open_region(HostMemory(ANON, Pinning.AUTO), MiB, device="cpu") as region:
        assert not region.pinned
        assert not region.tensor().is_pinned()


@pytest.mark.gpu
def test_gpu_unpin_on_close_and_unwrap() -> None:
    pinned = PinnedRegion.wrap(AnonymousRegion.allocate(MiB))
    inner = pinned.unwrap()
    assert not inner.tensor().is_pinned()
    again = PinnedRegion.wrap(inner)  # registrable again: it really was unregistered
    assert again.tensor().is_pinned()
    again.close()
    assert inner.closed


@pytest.mark.gpu
def test_gpu_chunked_registration_pins_every_chunk() -> None:
    n = 10 * PAGE + 123
    pinned = PinnedRegion.wrap(AnonymousRegion.allocate(n), row_bytes=PAGE, chunk_bytes=3 * PAGE)
    try:
        assert len(pinned.chunks) == 4
        t = pinned.tensor()
        for off, size in pinned.chunks:
            assert t[off:].is_pinned()
            assert t[off + size - 1 :].is_pinned()
    finally:
        pinned.close()


@pytest.mark.gpu
def test_gpu_failed_chunk_rolls_back_and_names_the_chunk() -> None:
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    inner = AnonymousRegion.allocate(8 * PAGE)
    blocker = inner.address + 4 * PAGE  # chunk 2 of 4 is registered by someone else
    assert int(cudart.cudaHostRegister(blocker, 2 * PAGE, 1)) == 0
    try:
        with pytest.raises(PinnedMemoryError, match=rf"chunk 2 of 4 \(offset {4 * PAGE},"):
            PinnedRegion.wrap(inner, row_bytes=PAGE, chunk_bytes=2 * PAGE)
        assert not inner.tensor()[:1].is_pinned()  # chunks 0 and 1 were unregistered
        # The failure does not linger in the runtime's last error for torch to trip over later.
        assert torch.ones(4, device="cuda").add_(1).sum().item() == 8
    finally:
        assert int(cudart.cudaHostUnregister(blocker)) == 0
        inner.close()


class _OldKernelMapping(mmap.mmap):
    """A mapping on a kernel without MADV_POPULATE_* (before 5.14), or one that is out of memory."""

    error = errno.EINVAL

    def madvise(self, option: int, *args: int) -> None:
        if option in (MADV_POPULATE_READ, MADV_POPULATE_WRITE):
            raise OSError(self.error, os.strerror(self.error))
        super().madvise(option, *args)


def test_prefault_touches_every_page_where_the_kernel_cannot_populate() -> None:
    m = _OldKernelMapping(-1, 64 * PAGE)
    t = torch.frombuffer(m, dtype=torch.uint8)
    address = int(t.data_ptr())
    assert prefault(m, t, write=True) == "touch"
    present, pages = resident_pages(address, 64 * PAGE)
    assert present == pages
    del t
    m.close()


def test_prefault_out_of_memory_is_an_error_not_a_fallback() -> None:
    m = _OldKernelMapping(-1, PAGE)
    m.error = errno.ENOMEM
    t = torch.frombuffer(m, dtype=torch.uint8)
    with pytest.raises(HostMemoryError, match=f"cannot pre-fault {PAGE} B"):
        prefault(m, t)
    del t
    m.close()
