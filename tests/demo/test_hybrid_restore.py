"""The demo's hybrid model restored from host through hicache matches a full recompute, and a
wrong restore (a corrupted page of any cache, state from another boundary) is caught."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import torch

from hicache.bootstrap.runtime import open_runtime
from hicache.demo.framework import DemoServer, Sequence, demo_plan
from hicache.demo.harness import cache_prefix, compare, differences, run_cached, run_recompute
from hicache.demo.model import HybridConfig, HybridLM, LayerKind
from hicache.domain import ConfigError, PoolName

PS = 64
CFG = HybridConfig()
MODEL = HybridLM(CFG)
TOL = 1e-5


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[DemoServer]:
    """The runtime is opened inside each test: its engine's task group cannot span a fixture."""
    plan = demo_plan(CFG, page_size=PS, device_pages=48, host_pages=96)
    async with open_runtime(plan, device="cpu") as rt:
        srv = DemoServer(rt, MODEL)
        yield srv
        # Nothing leaked: every device and host page and slot came back.
        full_dev = {p.name: rt.device.pool(p.name).pages for p in plan.independent_pools()}
        assert rt.device_slots.free_counts() == full_dev
        assert rt.host_slots.free_counts() == {p.name: p.pages for p in plan.independent_pools()}


def prompt(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, CFG.vocab, (n,), generator=gen)]


@pytest.mark.asyncio
@pytest.mark.parametrize(("length", "prefix"), [(448, 384), (200, 128), (130, 64)])
async def test_a_host_hit_matches_recompute_logit_for_logit_and_token_for_token(
    length: int, prefix: int
) -> None:
    async with serving() as server:
        result = await compare(server, prompt(length), prefix, decode_steps=3)
        assert result.max_abs_diff <= TOL
        assert result.tokens_identical
        assert len(result.cached.tokens) == 4
        assert result.cached.logits.shape == (length - prefix + 3, CFG.vocab)
        assert result.load.bytes > 0


@pytest.mark.asyncio
async def test_only_the_window_of_sliding_pages_is_restored() -> None:
    async with serving() as server:
        entry = await cache_prefix(server, prompt(384))
        try:
            assert len(entry.host_pages[PoolName.KV]) == 6
            # window 256 over pages of 64: the 4 pages before the boundary, not all 6.
            assert len(entry.host_pages[PoolName.SWA]) == 4
            assert entry.swa_first == 2
            assert len(entry.host_pages[PoolName.MAMBA]) == 1
        finally:
            server.free_host(entry)


def _rows(server: DemoServer, page: int) -> slice:
    return slice(page * server.page_size, (page + 1) * server.page_size)


def _kv_page(server: DemoServer, seq: Sequence) -> None:
    layer = CFG.layers_of(LayerKind.FULL)[0]
    server.caches.kv[layer][0][_rows(server, seq.kv[0])] += 0.5


def _indexer_page(server: DemoServer, seq: Sequence) -> None:
    layer = CFG.layers_of(LayerKind.FULL)[1]
    server.caches.index_k[layer][_rows(server, seq.kv[2])] += 0.5


def _sliding_page(server: DemoServer, seq: Sequence) -> None:
    layer = CFG.layers_of(LayerKind.SLIDING)[0]
    server.caches.kv[layer][1][_rows(server, seq.swa[max(seq.swa) - 1])] += 0.5


def _conv_state(server: DemoServer, seq: Sequence) -> None:
    server.caches.state[CFG.layers_of(LayerKind.DELTANET)[0]][0][seq.slot] += 0.5


def _temporal_state(server: DemoServer, seq: Sequence) -> None:
    server.caches.state[CFG.layers_of(LayerKind.DELTANET)[1]][1][seq.slot] += 0.5


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "tamper",
    [_kv_page, _indexer_page, _sliding_page, _conv_state, _temporal_state],
    ids=["kv-page", "indexer-page", "sliding-page", "conv-state", "temporal-state"],
)
async def test_a_corrupted_cache_of_any_kind_is_caught(
    tamper: Callable[[DemoServer, Sequence], None],
) -> None:
    async with serving() as server:
        result = await compare(server, prompt(448), 384, decode_steps=2, tamper=tamper)
        assert result.max_abs_diff > 1e3 * TOL


@pytest.mark.asyncio
async def test_state_from_another_boundary_is_caught() -> None:
    async with serving() as server:
        # KV of 6 pages, but the recurrent state checkpointed one page earlier.
        result = await compare(server, prompt(448), 384, decode_steps=2, state_at=320)
        assert result.max_abs_diff > 1e3 * TOL


@pytest.mark.asyncio
async def test_a_turn_backs_up_its_new_pages_and_the_next_turn_hits_them() -> None:
    async with serving() as server:
        first = prompt(200, seed=1)
        system = await cache_prefix(server, first[:128])
        try:
            _, _, saved = await run_cached(server, first, system, decode_steps=4, save_at=192)
            assert saved is not None
            assert len(saved.tokens) == 192
            try:
                second = [*saved.tokens, *prompt(40, seed=2)]
                ref = run_recompute(server, second, compare_from=192, decode_steps=2)
                server.scribble()
                got, _, _ = await run_cached(server, second, saved, decode_steps=2)
                worst, same = differences(ref, got)
                assert worst <= TOL
                assert same
            finally:
                server.free_host(saved)
        finally:
            server.free_host(system)


@pytest.mark.asyncio
async def test_bad_requests_raise_typed_errors_and_leave_nothing_behind() -> None:
    async with serving() as server:
        entry = await cache_prefix(server, prompt(128))
        try:
            with pytest.raises(ConfigError, match="not a proper prefix"):
                await run_cached(server, prompt(200, seed=9), entry, decode_steps=1)
            with pytest.raises(ConfigError, match="save_at=100 must be a page boundary"):
                await run_cached(server, prompt(200), entry, decode_steps=1, save_at=100)
        finally:
            server.free_host(entry)
        with pytest.raises(ConfigError, match="not a positive multiple of the page size"):
            await cache_prefix(server, prompt(100))
        seq = server.new_sequence(64)
        try:
            with pytest.raises(ConfigError, match="checkpoint boundaries"):
                server.prefill(seq, prompt(10), 0, checkpoints={64: seq.slot})
            with pytest.raises(ConfigError, match="sequences are live"):
                server.scribble()
        finally:
            server.free(seq)


def test_the_model_is_deterministic_and_every_layer_kind_is_present() -> None:
    again = HybridLM(CFG)
    assert all(
        torch.equal(a[k], b[k]) for a, b in zip(MODEL.layers, again.layers, strict=True) for k in a
    )
    assert {LayerKind.FULL, LayerKind.SLIDING, LayerKind.DELTANET} == set(CFG.pattern)
    plan = demo_plan(CFG)
    assert plan.transfer_layers == CFG.layers
    assert {p.name for p in plan.pools} == {
        PoolName.KV,
        PoolName.INDEXER,
        PoolName.SWA,
        PoolName.MAMBA,
    }


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_a_host_hit_on_a_gpu_matches_recompute() -> None:
    plan = demo_plan(CFG, page_size=PS, device_pages=48, host_pages=96)
    async with open_runtime(plan, device="cuda") as rt:
        server = DemoServer(rt, HybridLM(CFG, device="cuda"))
        result = await compare(server, prompt(448), 320, decode_steps=3)
        assert result.max_abs_diff <= TOL
        assert result.tokens_identical


class Boom(RuntimeError):
    pass


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before-any-layer", "after-the-load"])
async def test_a_request_failing_mid_restore_returns_every_page_and_pin(when: str) -> None:
    async with serving() as server:
        entry = await cache_prefix(server, prompt(384))
        try:

            def fail(_server: DemoServer, _seq: Sequence) -> None:
                raise Boom

            if when == "after-the-load":
                with pytest.raises(Boom):
                    await run_cached(server, prompt(448), entry, decode_steps=1, tamper=fail)
            else:
                real = server.prefill

                def failing_prefill(*args: object, **kw: object) -> torch.Tensor:
                    if kw.get("wait") is not None:
                        seq, tokens, start = args
                        server.extend(seq, start + len(tokens))  # type: ignore[arg-type]
                        raise Boom  # the request dies before its forward pass waits on layer 0
                    return real(*args, **kw)  # type: ignore[arg-type]

                server.prefill = failing_prefill  # type: ignore[method-assign]
                with pytest.raises(Boom):
                    await run_cached(server, prompt(448), entry, decode_steps=1, save_at=448)
                server.prefill = real  # type: ignore[method-assign]
            assert len(server.rt.engine.device_pins) == 0
            assert len(server.rt.engine.host_pins) == 0
            # The entry is intact: the same prefix restores correctly afterwards.
            result = await compare(server, prompt(448), 384, decode_steps=1)
            assert result.max_abs_diff <= TOL
        finally:
            server.free_host(entry)
