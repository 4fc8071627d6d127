"""Copy backends behind the Transfer port: byte-exact round trips for every pool kind, layout,
dtype and backend; per-layer semantics; sidecars; errors; every archetype; shared memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.adapters.copy import (
    BACKENDS,
    ENV_BACKEND,
    GroupTransfer,
    NativeBuildError,
    default_backend,
    load_native,
    make_transfer,
)
from hicache.adapters.device_pool import DeviceGroup
from hicache.adapters.host_pool import HostGroup, materialise_host_group
from hicache.bootstrap import load_model_spec
from hicache.domain import (
    AttentionSpec,
    BindingError,
    ConfigError,
    DType,
    ForeignIndexError,
    GatedDeltaNetSpec,
    HostGroupPlan,
    IndexerSpec,
    LayerKind,
    Layout,
    ModelSpec,
    PlanSettings,
    PoolName,
    PoolRole,
    StorageSettings,
    TransferError,
    plan_stack,
)
from hicache.domain.ports import PageMap, Transfer
from tests.adapters.pool_plans import (
    GEOMETRIES,
    framework_tensors,
    group_plan,
    host_page,
    my_segments,
    valid,
)

CPU_BACKENDS = ("naive", "torch", "memcpy")
POISON = 0xA5


# -- helpers -----------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def fill_random(device: DeviceGroup, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for pool in device:
        for layers in pool.buffers.values():
            for t in layers:
                b = raw(t)
                b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g).to(b.device))


def poison(device: DeviceGroup) -> None:
    for pool in device:
        for layers in pool.buffers.values():
            for t in layers:
                raw(t).fill_(POISON)


def snapshot(device: DeviceGroup) -> dict[tuple[PoolName, str, int], torch.Tensor]:
    return {
        (pool.name, name, i): raw(t).clone().cpu()
        for pool in device
        for name, layers in pool.buffers.items()
        for i, t in enumerate(layers)
    }


def device_page(t: torch.Tensor, page: int, p: int) -> torch.Tensor:
    return raw(t)[page * p : (page + 1) * p].cpu()


def page_maps(plan: HostGroupPlan, name: PoolName, device_pages: int, seed: int) -> PageMap:
    """Random, non-contiguous pages with a run of three pages consecutive on both sides."""
    rng = np.random.default_rng(seed)
    host_pages = plan.pool(name).pages
    n = min(5, device_pages - 1)
    hp = rng.permutation(host_pages)[:n].tolist()
    dp = rng.permutation(device_pages)[:n].tolist()
    # A run: host 5,6,7 -> device 1,2,3 (after removing collisions).
    run_h, run_d = [5, 6, 7], [1, 2, 3]
    pairs = [(h, d) for h, d in zip(hp, dp, strict=True) if h not in run_h and d not in run_d]
    hp = [h for h, _ in pairs] + run_h
    dp = [d for _, d in pairs] + run_d
    return PageMap(name, hp, dp)


def make(
    kind: str, layout: Layout, dtype: DType, backend: str
) -> tuple[HostGroup, DeviceGroup, GroupTransfer, HostGroupPlan, PoolName]:
    plan, name = group_plan(kind, layout, dtype)
    host = materialise_host_group(plan)
    device = DeviceGroup.allocate(plan)
    return host, device, make_transfer(host, device, backend=backend), plan, name


@pytest.fixture
def closing() -> Iterator[list[HostGroup]]:
    groups: list[HostGroup] = []
    yield groups
    for g in groups:
        g.close()


# -- the round trip ----------------------------------------------------------------------------

CASES = [
    (kind, layout, dtype)
    for kind in GEOMETRIES
    for layout in Layout
    if valid(kind, layout)  # the others raise LayoutError: test_invalid_layouts_raise
    for dtype in (
        (DType.BF16,) if kind in ("state", "indexer_fp8") else (DType.BF16, DType.FP8_E4M3)
    )
]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize(("kind", "layout", "dtype"), CASES, ids=lambda v: getattr(v, "value", v))
def test_round_trip_is_byte_exact(
    kind: str, layout: Layout, dtype: DType, backend: str, closing: list[HostGroup]
) -> None:
    host, device, transfer, plan, name = make(kind, layout, dtype, backend)
    closing.append(host)
    assert isinstance(transfer, Transfer)
    assert transfer.backends[name] == backend
    pool = plan.pool(name)
    dpool = device.pool(name)
    page_map = page_maps(plan, name, dpool.pages, seed=len(kind) + len(layout.value))
    fill_random(device, seed=1)
    before = snapshot(device)

    moved = transfer.backup([page_map])
    assert moved == len(page_map) * pool.page_size * pool.bytes_per_unit_per_layer * pool.layers
    # The host holds each device page at its host page, in the layout's own coordinates.
    hpool = host.pool(name)
    for spec in pool.geometry.buffers:
        for layer in range(pool.layers):
            for h, d in zip(page_map.host_pages, page_map.device_pages, strict=True):
                got = raw(host_page(hpool.buffers[spec.name], layout, layer, h, pool.page_size))
                want = device_page(dpool.buffers[spec.name][layer], d, pool.page_size)
                assert torch.equal(got.contiguous().view(-1), want.contiguous().view(-1))

    poison(device)
    total = sum(transfer.load_layer(t, [page_map]) for t in range(transfer.transfer_layers))
    assert total == moved
    p = pool.page_size
    for spec in pool.geometry.buffers:
        for layer, t in enumerate(dpool.buffers[spec.name]):
            for d in range(dpool.pages):
                got = device_page(t, d, p)
                if d in page_map.device_pages:
                    want = device_page(before[(name, spec.name, layer)], d, p)
                    assert torch.equal(got, want), (spec.name, layer, d)
                else:  # pages that were not loaded keep the poison
                    assert bool((got == POISON).all()), (spec.name, layer, d)


@pytest.mark.parametrize("page_size", [2, 32])  # 2 KiB pages (staged path), 16 KiB (runs)
@pytest.mark.parametrize("layout", list(Layout))
def test_big_and_small_pages_round_trip_with_every_backend(
    layout: Layout, page_size: int, closing: list[HostGroup]
) -> None:
    from hicache.domain import HostMemory, KVGeometry, MemoryKind
    from tests.adapters.pool_plans import pool_plan

    geo = KVGeometry(kv_heads=4, head_dim=64)
    kv = pool_plan(
        PoolName.KV, PoolRole.ANCHOR, geo, transfer=[0, 1], layout=layout, page_size=page_size
    )
    plan = HostGroupPlan(host_memory=HostMemory(MemoryKind("anonymous")), pools=[kv])
    device = DeviceGroup.allocate(plan)
    m = PageMap(PoolName.KV, [6, 7, 0, 3, 2], [0, 1, 5, 3, 2])  # a run, then scattered pages
    fill_random(device, seed=11)
    before = snapshot(device)
    for backend in CPU_BACKENDS:
        host = materialise_host_group(plan)
        closing.append(host)
        transfer = make_transfer(host, device, backend=backend)
        transfer.backup([m])
        poison(device)
        for t in range(2):
            transfer.load_layer(t, [m])
        after = snapshot(device)
        for key, t in after.items():
            for d in range(6):
                got = device_page(t, d, page_size)
                if d in m.device_pages:
                    assert torch.equal(got, device_page(before[key], d, page_size)), backend
                else:
                    assert bool((got == POISON).all()), backend
        for key, t in before.items():  # restore the original bytes for the next backend
            pool, buf, layer = key
            raw(device.pool(pool).buffers[buf][layer]).copy_(t)


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("state", Layout.LAYER_FIRST),
        ("state", Layout.PAGE_HEAD),
        ("mla", Layout.PAGE_HEAD),
    ],
)
def test_invalid_layouts_raise(kind: str, layout: Layout) -> None:
    from hicache.domain import LayoutError

    with pytest.raises(LayoutError, match=layout.value):
        group_plan(kind, layout)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fp8_nan_and_negative_zero_bytes_survive(backend: str, closing: list[HostGroup]) -> None:
    host, device, transfer, _, _ = make("mha", Layout.PAGE_FIRST_DIRECT, DType.FP8_E4M3, backend)
    closing.append(host)
    special = torch.tensor([0x7F, 0xFF, 0x80, 0x00, 0x7E], dtype=torch.uint8)
    for layers in device.pool("kv").buffers.values():
        for t in layers:
            raw(t).view(-1).copy_(special.repeat(raw(t).numel() // 5 + 1)[: raw(t).numel()])
    before = snapshot(device)
    m = PageMap(PoolName.KV, [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5])
    transfer.backup([m])
    poison(device)
    for t in range(transfer.transfer_layers):
        transfer.load_layer(t, [m])
    assert all(torch.equal(v, snapshot(device)[k]) for k, v in before.items())


# -- per-layer semantics -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT])
def test_load_layer_moves_exactly_one_transfer_layer(
    backend: str, layout: Layout, closing: list[HostGroup]
) -> None:
    # KV on transfer layers 1, 3; Mamba state on 0, 2.
    host, device, transfer, plan, _ = make("state", layout, DType.BF16, backend)
    closing.append(host)
    fill_random(device, seed=2)
    before = snapshot(device)
    kv = PageMap(PoolName.KV, [0, 2, 3], [4, 0, 1])
    mamba = PageMap(PoolName.MAMBA, [6, 1], [2, 4])
    transfer.backup([kv, mamba])
    poison(device)
    expected = transfer.layer_bytes(2, [kv, mamba])
    assert expected == 2 * plan.pool("mamba").bytes_per_unit_per_layer
    assert transfer.load_layer(2, [kv, mamba]) == expected
    after = snapshot(device)
    for (pool, buf, layer), t in after.items():
        restored = pool is PoolName.MAMBA and layer == 1  # transfer layer 2 = mamba layer 1
        if not restored:
            assert bool((t == POISON).all()), (pool, buf, layer)
            continue
        for d in range(device.pool(pool).pages):
            got = device_page(t, d, 1)
            want = device_page(before[(pool, buf, layer)], d, 1)
            assert torch.equal(got, want) if d in (2, 4) else bool((got == POISON).all())
    # Transfer layer 3 is KV layer 1 only.
    assert transfer.load_layer(3, [kv, mamba]) == 3 * plan.pool("kv").bytes_per_page // 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backup_layer_writes_one_layer(backend: str, closing: list[HostGroup]) -> None:
    host, device, transfer, _, _ = make("mha", Layout.LAYER_FIRST, DType.BF16, backend)
    closing.append(host)
    fill_random(device, seed=3)
    m = PageMap(PoolName.KV, [1, 2], [3, 0])
    for buf in host.pool("kv").buffers.values():
        raw(buf).fill_(0)
    assert transfer.backup_layer(2, [m]) == transfer.layer_bytes(2, [m])
    for name, buf in host.pool("kv").buffers.items():
        for layer in range(4):
            written = bool(raw(buf[layer]).any())
            assert written == (layer == 2), (name, layer)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sidecar_follows_the_anchor_pages(backend: str, closing: list[HostGroup]) -> None:
    host, device, transfer, plan, _ = make("indexer_fp8", Layout.PAGE_FIRST, DType.BF16, backend)
    closing.append(host)
    fill_random(device, seed=4)
    before = snapshot(device)
    kv = PageMap(PoolName.KV, [7, 0, 3], [2, 5, 0])
    moved = transfer.backup([kv])  # no indexer map: it follows the anchor
    assert moved == 3 * (plan.pool("kv").bytes_per_page + plan.pool("indexer").bytes_per_page)
    poison(device)
    for t in range(transfer.transfer_layers):
        transfer.load_layer(t, [kv])
    after = snapshot(device)
    for layer in range(3):
        for d in (2, 5, 0):
            key = (PoolName.INDEXER, "k", layer)
            assert torch.equal(device_page(after[key], d, 4), device_page(before[key], d, 4))
    # An explicit sidecar map must be the anchor's.
    transfer.load_layer(0, [kv, PageMap(PoolName.INDEXER, [7, 0, 3], [2, 5, 0])])
    with pytest.raises(ConfigError, match="borrows the anchor's pages"):
        transfer.load_layer(0, [kv, PageMap(PoolName.INDEXER, [7, 0, 3], [2, 5, 1])])


def test_backends_agree_on_the_host_bytes(closing: list[HostGroup]) -> None:
    plan, name = group_plan("mha", Layout.PAGE_HEAD)
    device = DeviceGroup.allocate(plan)
    fill_random(device, seed=5)
    m = PageMap(name, [3, 4, 5, 0, 7], [0, 1, 2, 5, 4])
    images = []
    for backend in CPU_BACKENDS:
        host = materialise_host_group(plan)
        closing.append(host)
        make_transfer(host, device, backend=backend).backup([m])
        images.append({k: raw(v).clone() for k, v in host.pool(name).buffers.items()})
    for other in images[1:]:
        assert all(torch.equal(images[0][k], other[k]) for k in images[0])


# -- errors ------------------------------------------------------------------------------------


def test_bad_maps_and_layers_are_typed_errors(closing: list[HostGroup]) -> None:
    host, device, transfer, _, _ = make("state", Layout.PAGE_FIRST, DType.BF16, "memcpy")
    closing.append(host)
    with pytest.raises(ForeignIndexError, match=r"device pages \[6\] are out of range"):
        transfer.load_layer(1, [PageMap(PoolName.KV, [0], [6])])
    with pytest.raises(ForeignIndexError, match=r"host pages \[8\]"):
        transfer.backup([PageMap(PoolName.KV, [8], [0])])
    with pytest.raises(ConfigError, match="must not repeat"):
        transfer.load_layer(1, [PageMap(PoolName.KV, [0, 1], [2, 2])])
    with pytest.raises(ConfigError, match="must not repeat"):
        transfer.backup([PageMap(PoolName.KV, [1, 1], [2, 3])])
    with pytest.raises(ConfigError, match="no pool 'swa'"):
        transfer.backup([PageMap(PoolName.SWA, [0], [0])])
    with pytest.raises(ConfigError, match="more than one page map"):
        transfer.backup([PageMap(PoolName.KV, [0], [0]), PageMap(PoolName.KV, [1], [1])])
    with pytest.raises(BindingError, match="transfer layer 4 is out of range"):
        transfer.load_layer(4, [PageMap(PoolName.KV, [0], [0])])
    with pytest.raises(ConfigError, match="list or tuple of PageMap"):
        transfer.backup(PageMap(PoolName.KV, [0], [0]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown copy backend 'fast'"):
        make_transfer(host, device, backend="fast")
    with pytest.raises(ConfigError, match="names pools"):
        make_transfer(host, device, backend={"swa": "torch"})
    mixed = make_transfer(host, device, backend={"mamba": "torch"})
    assert mixed.backends == {PoolName.KV: "memcpy", PoolName.MAMBA: "torch"}
    assert "kv=memcpy" in repr(mixed)
    # Nothing to copy is not an error.
    assert transfer.backup([PageMap(PoolName.KV, [], [])]) == 0


def test_backend_failures_become_transfer_errors_with_context(closing: list[HostGroup]) -> None:
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    host = materialise_host_group(plan)
    closing.append(host)
    tensors = framework_tensors(plan.anchor)
    device = DeviceGroup.wrap(plan, {"kv": tensors})
    transfer = make_transfer(host, device, backend="naive")
    tensors["v"][2].requires_grad_(True)  # the framework's leaf now refuses in-place copies
    m = PageMap(PoolName.KV, [4, 1], [0, 3])
    with pytest.raises(TransferError, match=r"load of transfer layer 2 .*pool 'kv'.*naive") as info:
        transfer.load_layer(2, [m])
    assert "host pages [4, 1]" in str(info.value)
    assert "device pages [0, 3]" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_closed_host_group_is_never_copied_into(closing: list[HostGroup]) -> None:
    host, _, transfer, _, _ = make("mha", Layout.PAGE_FIRST, DType.BF16, "memcpy")
    host.close()
    with pytest.raises(TransferError, match="host group is closed"):
        transfer.load_layer(0, [PageMap(PoolName.KV, [0], [0])])
    with pytest.raises(TransferError, match="host group is closed"):
        transfer.backup([PageMap(PoolName.KV, [0], [0])])


def test_missing_compiler_is_an_explicit_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closing: list[HostGroup]
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("HICACHE_NATIVE_DIR", str(tmp_path / "native"))
    plan, _ = group_plan("mha", Layout.PAGE_FIRST)
    host = materialise_host_group(plan)
    closing.append(host)
    device = DeviceGroup.allocate(plan)
    assert default_backend("cpu", "mha", 16) == "memcpy"
    for backend in ("auto", "memcpy"):
        with pytest.raises(NativeBuildError, match=r"no-such-cc.*not found.*'torch' explicitly"):
            make_transfer(host, device, backend=backend)
    # The portable backend, chosen explicitly (by argument or by environment), works.
    assert make_transfer(host, device, backend="torch").backends[PoolName.KV] == "torch"
    monkeypatch.setenv(ENV_BACKEND, "torch")
    assert make_transfer(host, device).backends[PoolName.KV] == "torch"
    monkeypatch.setenv(ENV_BACKEND, "warp")
    with pytest.raises(ConfigError, match=r"\$HICACHE_COPY_BACKEND: unknown copy backend 'warp'"):
        make_transfer(host, device)


def test_native_helper_builds_from_a_fresh_folder(tmp_path: Path) -> None:
    lib = load_native(cache_dir=tmp_path)
    assert lib.path.parent == tmp_path
    assert lib.path.name.startswith("hicache-memcpy-")
    assert [p.name for p in tmp_path.iterdir()] == [lib.path.name]  # no build leftovers
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    n = lib.copy(
        np.array([dst.data_ptr()], dtype=np.int64),
        np.array([src.data_ptr()], dtype=np.int64),
        np.array([8], dtype=np.int64),
        np.array([40], dtype=np.int64),
        np.array([16], dtype=np.int64),
    )
    assert n == 16
    assert torch.equal(dst[8:24], src[40:56])
    assert int(dst[:8].sum()) == 0


def test_backend_names() -> None:
    assert set(BACKENDS) == {"naive", "torch", "memcpy", "cuda_batch"}


# -- every archetype ---------------------------------------------------------------------------


def kv_swa_state_spec() -> ModelSpec:
    f, s, lin = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION, LayerKind.LINEAR_ATTENTION
    return ModelSpec(
        model_type="qwen3_5_like",
        layer_kinds=(lin, s, lin, f, lin, s, lin, f),
        attention=AttentionSpec(kv_heads=2, head_dim=32),
        sliding_window=128,
        state=GatedDeltaNetSpec(
            key_heads=2, value_heads=2, key_dim=16, value_dim=16, conv_kernel=4
        ),
    )


def mha_indexer_spec() -> ModelSpec:
    return ModelSpec(
        model_type="minimax_like",
        layer_kinds=(LayerKind.FULL_ATTENTION,) * 4,
        attention=AttentionSpec(kv_heads=2, head_dim=32),
        indexer=IndexerSpec(heads=1, head_dim=64),
    )


ARCHETYPES = [
    ("llama-3.1-8b-instruct", 1, "dense_kv"),
    ("deepseek-v3", 1, "mla"),
    ("gpt-oss-20b", 1, "kv_swa"),
    ("qwen3-next-80b-a3b-instruct", 16, "kv_state"),
    ("nemotron-h-8b-base-8k", 8, "kv_state"),
    ("deepseek-v3.2-exp", 1, "kv_indexer"),
    ("kv_swa_state", 1, "kv_swa_state"),
    ("mha_indexer", 1, "kv_indexer"),
]


def spec_of(model: str) -> ModelSpec:
    if model == "kv_swa_state":
        return kv_swa_state_spec()
    if model == "mha_indexer":
        return mha_indexer_spec()
    return load_model_spec(model)


@pytest.mark.parametrize(("model", "tp", "archetype"), ARCHETYPES, ids=[a[0] for a in ARCHETYPES])
def test_every_archetype_materialises_and_round_trips(
    model: str, tp: int, archetype: str, closing: list[HostGroup]
) -> None:
    spec = spec_of(model)
    settings = PlanSettings(
        tp_size=tp,
        page_size=16,
        device_tokens=64,
        device_slots=2,
        layout=Layout.PAGE_FIRST_DIRECT,
        pool_layouts={"mamba": Layout.PAGE_FIRST} if spec.state is not None else {},
    )
    plan = plan_stack(spec, settings)
    assert plan.archetype == archetype
    host = materialise_host_group(plan)
    closing.append(host)
    device = DeviceGroup.allocate(plan)
    transfer = make_transfer(host, device)
    fill_random(device, seed=6)
    before = snapshot(device)
    maps = []
    for pool in plan.independent_pools():
        n = min(3, device.pool(pool.name).pages)
        maps.append(PageMap(pool.name, list(range(pool.pages - n, pool.pages)), list(range(n))))
    transfer.backup(maps)
    poison(device)
    for t in range(transfer.transfer_layers):
        transfer.load_layer(t, maps)
    after = snapshot(device)
    for pool in plan.pools:
        owner = pool.name if pool.name in {m.pool for m in maps} else plan.anchor.name
        loaded = next(m for m in maps if m.pool is owner).device_pages
        for (name, buf, layer), t in after.items():
            if name is not pool.name:
                continue
            for d in loaded:
                got = device_page(t, d, pool.page_size)
                assert torch.equal(got, device_page(before[(name, buf, layer)], d, pool.page_size))


# -- the allocator story, end to end, nothing patched ------------------------------------------

READER = textwrap.dedent(
    """
    import hashlib, json, mmap, os, sys
    out = {}
    for name in json.loads(sys.argv[1]):
        fd = os.open("/dev/shm/" + name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        out[name] = hashlib.sha256(m[:]).hexdigest()
        m[0] = 0x42  # a write the owner must see
        m.close()
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("model", ["kv_swa_state", "mha_indexer"])
def test_dynamic_shm_allocator_puts_every_pool_in_shared_memory(
    model: str, closing: list[HostGroup]
) -> None:
    import hashlib

    storage = StorageSettings(backend="dynamic", extra_config='{"allocator": "shm"}')
    plan = plan_stack(
        spec_of(model),
        PlanSettings(page_size=16, device_tokens=64, device_slots=2, storage=storage),
    )
    names = {p.name.value for p in plan.pools}
    assert names == ({"kv", "swa", "mamba"} if model == "kv_swa_state" else {"kv", "indexer"})
    before = my_segments()
    host = materialise_host_group(plan)
    closing.append(host)
    regions = host.regions()
    assert {p for p, _, _ in regions} == {p.name for p in plan.pools}
    for pool, buf, region in regions:
        assert region.kind.name == "shm", (pool, buf)
        assert region.shm_name is not None
        t = region.tensor()
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
    ours = {
        r.shm_name: hashlib.sha256(r.tensor().numpy().tobytes()).hexdigest() for *_, r in regions
    }
    assert set(ours) <= my_segments() - before
    done = subprocess.run(
        [sys.executable, "-c", READER, json.dumps(sorted(ours))],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == ours
    for *_, region in regions:
        assert int(region.tensor()[0]) == 0x42
    host.close()
    assert my_segments() == before  # nothing left under /dev/shm


@pytest.mark.parametrize(
    ("kind", "layout"), [("mha", lay) for lay in Layout] + [("state", Layout.PAGE_FIRST)]
)
def test_cuda_batch_copy_lists_round_trip_when_run_as_memcpy(
    kind: str, layout: Layout, closing: list[HostGroup]
) -> None:
    """The (dst, src, size) lists cuda_batch submits, executed on CPU, are a correct copy."""
    from hicache.adapters.copy.cuda_batch import _flat

    host, device, transfer, plan, name = make(kind, layout, DType.BF16, "memcpy")
    closing.append(host)
    lib = load_native()
    m = page_maps(plan, name, device.pool(name).pages, seed=9)
    pool = transfer._pools[name]
    (_, pages) = transfer._pagesets([m])[-1]
    zero = np.zeros(1, dtype=np.int64)

    def run(load: bool, layers: tuple[int, ...] | None) -> None:
        for bp in pool.pair.buffers:
            dsts, srcs, sizes = _flat(bp, layers, pages, load=load)
            lib.copy(zero, zero, np.ascontiguousarray(dsts), np.ascontiguousarray(srcs), sizes)

    fill_random(device, seed=10)
    before = snapshot(device)
    run(load=False, layers=None)
    poison(device)
    for layer in range(plan.pool(name).layers):
        run(load=True, layers=(layer,))
    after = snapshot(device)
    p = plan.pool(name).page_size
    for (pool_name, buf, layer), t in after.items():
        if pool_name is not name:
            continue
        for d in range(device.pool(name).pages):
            got = device_page(t, d, p)
            if d in m.device_pages:
                assert torch.equal(got, device_page(before[(pool_name, buf, layer)], d, p))
            else:
                assert bool((got == POISON).all())


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["naive", "torch", "cuda_batch"])
@pytest.mark.parametrize("layout", list(Layout))
def test_cuda_round_trip_is_byte_exact(backend: str, layout: Layout) -> None:
    from hicache.domain import HostMemory, MemoryKind, Pinning

    plan, name = group_plan("mha", layout, memory=HostMemory(MemoryKind("anonymous"), Pinning.ON))
    host = materialise_host_group(plan, device="cuda")
    try:
        assert host.anchor.pinned
        device = DeviceGroup.allocate(plan, device="cuda")
        transfer = make_transfer(host, device, backend=backend)
        fill_random(device, seed=7)
        before = snapshot(device)
        m = page_maps(plan, name, device.pool(name).pages, seed=8)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            transfer.backup([m])
        stream.synchronize()
        poison(device)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            for t in range(transfer.transfer_layers):
                transfer.load_layer(t, [m])
        stream.synchronize()
        after = snapshot(device)
        for (pool, buf, layer), t in after.items():
            for d in range(device.pool(pool).pages):
                got = device_page(t, d, 4)
                if d in m.device_pages:
                    assert torch.equal(got, device_page(before[(pool, buf, layer)], d, 4))
                else:
                    assert bool((got == POISON).all())
    finally:
        host.close()


@pytest.mark.gpu
def test_cuda_batch_refuses_the_default_stream() -> None:
    from hicache.domain import HostMemory, MemoryKind, Pinning

    plan, name = group_plan(
        "mha", Layout.PAGE_FIRST, memory=HostMemory(MemoryKind("anonymous"), Pinning.ON)
    )
    host = materialise_host_group(plan, device="cuda")
    try:
        device = DeviceGroup.allocate(plan, device="cuda")
        transfer = make_transfer(host, device, backend="cuda_batch")
        with pytest.raises(TransferError, match="default stream"):
            transfer.load_layer(0, [PageMap(name, [0], [0])])
    finally:
        host.close()
