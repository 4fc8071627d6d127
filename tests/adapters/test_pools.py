"""Host and device pools: materialisation on the group's memory, layouts, page objects, wrapping."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import pytest
import torch

from hicache.adapters.device_pool import DeviceGroup, DevicePool, parse_torch_device
from hicache.adapters.dtypes import accepted_dtypes, as_storage, torch_dtype
from hicache.adapters.host_memory import register_store_provider, unregister_store_provider
from hicache.adapters.host_pool import materialise_host_group
from hicache.domain import (
    ConfigError,
    DeviceError,
    DType,
    ForeignIndexError,
    HostMemory,
    HostMemoryError,
    LayerBinding,
    Layout,
    LayoutError,
    MemoryKind,
    Pinning,
    PoolName,
    PoolPlan,
    PoolRole,
)
from tests.adapters.pool_plans import (
    GEOMETRIES,
    PAGE,
    framework_tensors,
    group_plan,
    host_page,
    my_segments,
    valid,
)

SHM = HostMemory(MemoryKind("shm"), Pinning.AUTO)
STORE = HostMemory(MemoryKind("store:mooncake"), Pinning.AUTO)

# Geometries of every pool kind (small; K and V head dims differ on purpose).


# -- dtypes ------------------------------------------------------------------------------------


def test_dtypes_store_fp8_as_bytes() -> None:
    assert torch_dtype(DType.BF16) is torch.bfloat16
    assert torch_dtype(DType.FP32) is torch.float32
    assert torch_dtype(DType.FP8_E4M3) is torch.uint8
    assert torch_dtype(DType.FP8_E5M2) is torch.uint8
    assert torch.uint8 in accepted_dtypes(DType.FP8_E4M3)
    native = torch.zeros(4, dtype=torch.float8_e4m3fn)
    view = as_storage(native, DType.FP8_E4M3)
    assert view.dtype is torch.uint8
    assert view.data_ptr() == native.data_ptr()
    with pytest.raises(ConfigError, match="cannot hold"):
        as_storage(torch.zeros(2, dtype=torch.float32), DType.BF16)


# -- host pools --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("kind", list(GEOMETRIES))
def test_materialise_builds_each_buffer_in_its_layout_zero_copy(kind: str, layout: Layout) -> None:
    if not valid(kind, layout):
        with pytest.raises(LayoutError):
            group_plan(kind, layout)
        return
    plan, name = group_plan(kind, layout)
    with materialise_host_group(plan) as group:
        pool = group.pool(name)
        assert list(pool.buffers) == [b.name for b in pool.plan.geometry.buffers]
        for spec in pool.plan.geometry.buffers:
            buf = pool.buffers[spec.name]
            region = pool.regions[spec.name]
            assert tuple(buf.shape) == pool.plan.host_buffer_shapes()[spec.name]
            assert buf.dtype is torch_dtype(spec.dtype)
            assert region.kind.name == "anonymous"
            assert buf.data_ptr() == region.address  # a view of the region, no copy
            assert region.nbytes == buf.numel() * buf.element_size()
            buf.view(torch.uint8).view(-1)[-1] = 0x5A
            assert int(region.tensor()[-1]) == 0x5A
        assert sum(b.numel() * b.element_size() for b in pool.buffers.values()) == pool.nbytes


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD])
def test_page_objects_are_whole_pages_of_every_layer(layout: Layout) -> None:
    plan, _ = group_plan("mha", layout)
    with materialise_host_group(plan) as group:
        pool = group.anchor
        for buf in pool.buffers.values():
            raw = buf.view(torch.uint8).view(-1)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        page = 5
        objects = pool.page_objects(page)
        assert len(objects) == 2
        assert sum(size for _, size in objects) == pool.plan.bytes_per_page
        for (address, size), (name, buf) in zip(objects, pool.buffers.items(), strict=True):
            # The layout's definition of one page of all layers (layouts.py).
            first = layout is Layout.PAGE_FIRST
            whole = buf[page * PAGE : (page + 1) * PAGE] if first else buf[page]
            got = ctypes.string_at(address, size)
            assert got == whole.contiguous().view(torch.uint8).numpy().tobytes(), name
            # ... and it holds exactly every layer's page.
            layers = b"".join(
                host_page(buf, layout, layer, page, PAGE)
                .contiguous()
                .view(torch.uint8)
                .numpy()
                .tobytes()
                for layer in range(pool.layers)
            )
            assert sorted(got) == sorted(layers)
            view = pool.page_views(page)[list(pool.buffers).index(name)]
            assert view.is_contiguous()
            assert view.data_ptr() == address


def test_page_objects_need_a_page_first_layout_and_a_page_of_the_pool() -> None:
    plan, _ = group_plan("mha", Layout.LAYER_FIRST)
    with materialise_host_group(plan) as group, pytest.raises(LayoutError, match="layer_first"):
        group.anchor.page_objects(0)
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    with materialise_host_group(plan) as group, pytest.raises(ForeignIndexError, match="page 8"):
        group.anchor.page_objects(8)


def test_state_slot_is_one_contiguous_object_per_tensor() -> None:
    plan, name = group_plan("state", Layout.PAGE_FIRST)
    with materialise_host_group(plan) as group:
        pool = group.pool(name)
        objects = pool.page_objects(3)
        assert [size for _, size in objects] == [
            spec.nbytes * pool.layers for spec in pool.plan.geometry.buffers
        ]


def test_group_allocator_slots_and_repr() -> None:
    plan, _ = group_plan("indexer", Layout.PAGE_FIRST)
    group = materialise_host_group(plan)
    taken = group.allocator.allocate({PoolName.KV: 3})
    assert taken[PoolName.KV] == (0, 1, 2)
    assert "3/8 pages used" in repr(group.pool(PoolName.KV))
    # The sidecar borrows the anchor's pages: same free list.
    assert group.pool(PoolName.INDEXER).allocator is group.pool(PoolName.KV).allocator
    assert "3/8 pages used" in repr(group.pool(PoolName.INDEXER))
    group.allocator.free(taken)
    assert "0/8 pages used" in repr(group)
    group.close()
    group.close()  # idempotent
    assert "closed" in repr(group)
    assert "closed" in repr(group.pool(PoolName.KV))
    with pytest.raises(HostMemoryError, match="closed"):
        _ = group.pool(PoolName.KV).buffers


def test_pool_takes_its_memory_from_the_group_only() -> None:
    plan, _ = group_plan("state", Layout.PAGE_FIRST, memory=SHM)
    before = my_segments()
    with materialise_host_group(plan) as group:
        kinds = {region.kind.name for _, _, region in group.regions()}
        assert kinds == {"shm"}
        assert len(my_segments() - before) == len(group.regions())
    assert my_segments() == before


class FakeStore:
    """A store that lends host memory (plain tensors) and fails after ``limit`` allocations."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lent: list[FakeBuffer] = []
        self.released: list[FakeBuffer] = []

    def allocate(self, nbytes: int) -> FakeBuffer:
        if len(self.lent) >= self.limit:
            raise RuntimeError("the store is out of registered memory")
        buf = FakeBuffer(torch.zeros(nbytes, dtype=torch.uint8))
        self.lent.append(buf)
        return buf

    def release(self, buffer: FakeBuffer) -> None:
        self.released.append(buffer)


class FakeBuffer:
    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    @property
    def address(self) -> int:
        return int(self._t.data_ptr())

    @property
    def nbytes(self) -> int:
        return self._t.numel()

    def tensor(self) -> torch.Tensor:
        return self._t


@pytest.fixture
def fake_store() -> Iterator[Callable[[int], FakeStore]]:
    made: list[str] = []

    def make(limit: int) -> FakeStore:
        store = FakeStore(limit)
        register_store_provider("mooncake", store)
        made.append("mooncake")
        return store

    yield make
    for name in made:
        unregister_store_provider(name)


def test_store_owned_memory_serves_every_pool(fake_store: Callable[[int], FakeStore]) -> None:
    store = fake_store(100)
    plan, _ = group_plan("state", Layout.PAGE_FIRST, memory=STORE)
    with materialise_host_group(plan) as group:
        assert {r.kind.name for _, _, r in group.regions()} == {"store:mooncake"}
        assert len(store.lent) == 4  # k, v, conv, temporal
    assert sorted(map(id, store.released)) == sorted(map(id, store.lent))


def test_failed_materialisation_closes_what_it_opened(
    fake_store: Callable[[int], FakeStore],
) -> None:
    store = fake_store(3)  # k, v and conv succeed; the temporal state's region fails
    plan, _ = group_plan("state", Layout.PAGE_FIRST, memory=STORE)
    with pytest.raises(HostMemoryError, match="out of registered memory"):
        materialise_host_group(plan)
    assert len(store.lent) == 3
    assert sorted(map(id, store.released)) == sorted(map(id, store.lent))


# -- device pools ------------------------------------------------------------------------------


def test_allocate_per_layer_buffers_like_a_framework() -> None:
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    pool = DevicePool.allocate(plan.anchor)
    assert pool.capacity == plan.anchor.device_capacity == 24
    assert pool.pages == 6
    ks = pool.buffers["k"]
    assert len(ks) == 4
    assert tuple(ks[0].shape) == (24, 2, 16)
    assert tuple(pool.buffers["v"][3].shape) == (24, 2, 8)
    assert ks[0].dtype is torch.bfloat16
    stacked = pool.stacked("k")
    assert stacked is not None
    assert tuple(stacked.shape) == (4, 24, 2, 16)
    assert pool.layer("k", 2).data_ptr() == ks[2].data_ptr()
    assert "allocated" in repr(pool)


def test_allocate_checks_capacity() -> None:
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    with pytest.raises(DeviceError, match="not a whole number of pages"):
        DevicePool.allocate(plan.anchor, capacity=10)
    no_cap = PoolPlan(
        name=PoolName.KV,
        role=PoolRole.ANCHOR,
        geometry=GEOMETRIES["mha"],
        binding=LayerBinding.contiguous([0]),
        layout=Layout.PAGE_FIRST,
        page_size=PAGE,
        capacity=16,
    )
    with pytest.raises(DeviceError, match="no device capacity"):
        DevicePool.allocate(no_cap)
    pool = DevicePool.allocate(no_cap, capacity=8)
    assert pool.pages == 2


def test_wrap_adopts_framework_tensors_without_copying() -> None:
    plan, _ = group_plan("mha", Layout.PAGE_FIRST, DType.FP8_E4M3)
    kv = plan.anchor
    native = {
        spec.name: [torch.zeros((24, *spec.shape), dtype=torch.float8_e4m3fn) for _ in range(4)]
        for spec in kv.geometry.buffers
    }
    pool = DevicePool.wrap(kv, native)
    assert pool.capacity == 24
    assert pool.buffers["k"][1].dtype is torch.uint8  # fp8 is moved as bytes
    assert pool.buffers["k"][1].data_ptr() == native["k"][1].data_ptr()
    assert "wrapped" in repr(pool)
    # The block-scaled fp8 indexer packs values and scales as bytes: frameworks keep uint8.
    plan, name = group_plan("indexer_fp8", Layout.PAGE_FIRST)
    side = plan.pool(name)
    whole = torch.zeros((side.layers, 24, 1, 72), dtype=torch.uint8)
    pool = DevicePool.wrap(side, {"k": list(whole.unbind(0))})
    # Slices of one framework tensor (layer-major) keep their all-layer view.
    stacked = pool.stacked("k")
    assert stacked is not None
    assert stacked.data_ptr() == whole.data_ptr()
    with pytest.raises(
        DeviceError, match=r"dtype torch.float8_e4m3fn does not match the plan's uint8"
    ):
        DevicePool.wrap(side, {"k": [t.view(torch.float8_e4m3fn) for t in whole.unbind(0)]})


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda t: t.pop("v"), r"missing \['v'\]"),
        (lambda t: t.update(extra=[]), r"unexpected \['extra'\]"),
        (lambda t: t["k"].pop(), "got 3 layer tensors, the plan has 4 layers"),
        (
            lambda t: t["k"].__setitem__(2, torch.zeros((24, 2, 8), dtype=torch.bfloat16)),
            r"pool 'kv' buffer 'k' layer 2: shape \(24, 2, 8\) does not match the plan: "
            r"expected \(capacity, 2, 16\)",
        ),
        (
            lambda t: t["v"].__setitem__(1, torch.zeros((24, 2, 8), dtype=torch.float16)),
            r"pool 'kv' buffer 'v' layer 1: dtype torch.float16 does not match the plan's bf16",
        ),
        (
            lambda t: t["v"].__setitem__(3, torch.zeros((16, 2, 8), dtype=torch.bfloat16)),
            r"buffer 'v' layer 3: has 16 tokens, the pool's capacity is 24",
        ),
        (
            lambda t: t["k"].__setitem__(
                0, torch.zeros((2, 24, 16), dtype=torch.bfloat16).transpose(0, 1)
            ),
            r"layer 0: tensor is not contiguous",
        ),
    ],
)
def test_wrap_names_the_mismatch(mutate: object, match: str) -> None:
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    tensors = framework_tensors(plan.anchor)
    mutate(tensors)  # type: ignore[operator]
    with pytest.raises(DeviceError, match=match):
        DevicePool.wrap(plan.anchor, tensors)


def test_wrap_rejects_bad_capacity_and_grad_tensors() -> None:
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    with pytest.raises(DeviceError, match="not a whole number of pages of 4"):
        DevicePool.wrap(plan.anchor, framework_tensors(plan.anchor, capacity=10))
    tensors = framework_tensors(plan.anchor)
    tensors["k"][1].requires_grad_(True)
    with pytest.raises(DeviceError, match="layer 1: tensor requires grad"):
        DevicePool.wrap(plan.anchor, tensors)


def test_device_group_checks_pools_and_sidecar_capacity() -> None:
    plan, _ = group_plan("indexer", Layout.PAGE_FIRST)
    group = DeviceGroup.allocate(plan)
    assert group.pool("indexer").capacity == group.pool("kv").capacity
    with pytest.raises(DeviceError, match="capacity must be the anchor's 24"):
        DeviceGroup.allocate(plan, capacities={"indexer": 8})
    with pytest.raises(ConfigError, match="capacities name pools"):
        DeviceGroup.allocate(plan, capacities={"swa": 8})
    with pytest.raises(DeviceError, match=r"missing \['indexer'\]"):
        DeviceGroup.wrap(plan, {"kv": framework_tensors(plan.anchor)})
    wrapped = DeviceGroup.wrap(
        plan,
        {
            "kv": framework_tensors(plan.anchor),
            "indexer": framework_tensors(plan.pool("indexer")),
        },
    )
    assert wrapped.device == torch.device("cpu")


def test_device_names_are_checked_up_front() -> None:
    assert parse_torch_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="unknown device 'tpu'"):
        parse_torch_device("tpu")
    if torch.version.hip is None:
        with pytest.raises(DeviceError, match="not a ROCm build"):
            parse_torch_device("rocm")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match="sees none"):
            parse_torch_device("cuda")
        plan, _ = group_plan("mha", Layout.PAGE_FIRST)
        with pytest.raises(DeviceError):
            DevicePool.allocate(plan.anchor, device="cuda:0")
