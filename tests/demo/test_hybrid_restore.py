"""The demo's hybrid model served through hicache's cache face matches a full recompute, from
host and from a directory store, and a wrong restore (a corrupted page of any cache, state from
another boundary, a restored state the model ignores) is caught; nothing is left behind."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import pytest
import torch

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.demo.framework import DemoServer, Sequence, demo_plan
from hicache.demo.harness import (
    cache_prefix,
    compare,
    differences,
    evict_to,
    run_cached,
    run_recompute,
)
from hicache.demo.model import HybridLM, LayerKind
from hicache.domain import ConfigError, PoolName, Tier
from tests.demo.conftest import CFG, MODEL, PS, prompt, serving

TOL = 1e-5


@pytest.mark.asyncio
@pytest.mark.parametrize(("length", "prefix"), [(448, 384), (200, 128), (130, 64)])
async def test_a_host_hit_matches_recompute_logit_for_logit_and_token_for_token(
    length: int, prefix: int
) -> None:
    async with serving() as server:
        result = await compare(server, prompt(length), prefix, decode_steps=3)
        assert result.max_abs_diff <= TOL
        assert result.tokens_identical
        assert result.cached.hit == prefix
        assert len(result.cached.tokens) == 4
        assert result.cached.logits.shape == (length - prefix + 3, CFG.vocab)
        assert result.load.bytes > 0
        assert result.load.prefetch_s == 0.0
        assert 0.0 <= result.load.exposed_s <= result.load.copy_s


@pytest.mark.asyncio
async def test_a_storage_hit_after_the_host_copy_was_evicted_matches_recompute() -> None:
    with tempfile.TemporaryDirectory() as root:
        store = DirectoryStore(DirectorySettings(root=root))
        try:
            async with serving(store) as server:
                result = await compare(server, prompt(448), 384, decode_steps=3, tier="storage")
                stats = server.cache.statistics()
                assert result.max_abs_diff <= TOL
                assert result.tokens_identical
                assert result.cached.hit == 384
                assert result.load.prefetch_s > 0
                assert stats.prefetched_pages > 0  # it came back from the store
                assert stats.evictions.host > 0  # after the host copy was evicted
        finally:
            store.close()


@pytest.mark.asyncio
async def test_only_the_window_of_sliding_pages_and_the_last_state_are_loaded() -> None:
    async with serving() as server:
        await cache_prefix(server, prompt(384))
        await evict_to(server, "host")
        async with await server.cache.match(prompt(384)) as m:
            # window 256 over pages of 64: the 4 pages before the boundary, not all 6.
            assert m.load_counts() == {PoolName.KV: 6, PoolName.SWA: 4, PoolName.MAMBA: 1}


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
    server.caches.kv[layer][1][_rows(server, seq.swa[4])] += 0.5  # page 4 of the 6 restored


def _conv_state(server: DemoServer, seq: Sequence) -> None:
    assert seq.state_from is not None
    server.caches.state[CFG.layers_of(LayerKind.DELTANET)[0]][0][seq.state_from] += 0.5


def _temporal_state(server: DemoServer, seq: Sequence) -> None:
    assert seq.state_from is not None
    server.caches.state[CFG.layers_of(LayerKind.DELTANET)[1]][1][seq.state_from] += 0.5


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
async def test_a_restored_state_the_model_ignores_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = DemoServer.prefill

    def forgetful(self: DemoServer, seq: Sequence, *args: object, **kw: object) -> torch.Tensor:
        seq.state_from = None  # the framework forgot to start from the restored checkpoint
        return real(self, seq, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(DemoServer, "prefill", forgetful)
    async with serving() as server:
        result = await compare(server, prompt(448), 384, decode_steps=2)
        assert not result.max_abs_diff <= TOL


@pytest.mark.asyncio
async def test_a_turn_inserts_its_pages_and_the_next_turn_hits_them() -> None:
    async with serving() as server:
        first = prompt(200, seed=1)
        await cache_prefix(server, first[:128])
        await evict_to(server, "host")
        run, _ = await run_cached(server, first, decode_steps=4)
        assert run.hit == 128
        text = [*first, *run.tokens[:4]]  # 204 positions computed: 3 full pages inserted
        second = [*text[:192], *prompt(40, seed=2)]
        ref = run_recompute(server, second, compare_from=192, decode_steps=2)
        await evict_to(server, "host")
        got, _ = await run_cached(server, second, decode_steps=2, insert=False)
        assert got.hit == 192  # the state checkpoint the face asked for at the end of the insert
        worst, same = differences(ref, got)
        assert worst <= TOL
        assert same


@pytest.mark.asyncio
async def test_bad_requests_raise_typed_errors_and_leave_nothing_behind() -> None:
    async with serving() as server:
        with pytest.raises(ConfigError, match="prefix_tokens=100 must be a whole number"):
            await compare(server, prompt(200), 100)
        with pytest.raises(ConfigError, match="state_at=200 must lie in"):
            await cache_prefix(server, prompt(128), state_at=200)
        with pytest.raises(ConfigError, match="tier 'disk'"):
            await evict_to(server, "disk")
        seq = server.new_sequence(64)
        try:
            with pytest.raises(ConfigError, match="checkpoint boundaries"):
                server.prefill(seq, prompt(10), 0, checkpoints={64: seq.slot})
            with pytest.raises(ConfigError, match="sequences are live"):
                server.scribble()
        finally:
            server.free(seq)
        await cache_prefix(server, prompt(128))
        with pytest.raises(ConfigError, match="cached on the device"):
            server.scribble()


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
    assert Tier.DEVICE is not Tier.HOST


@pytest.mark.gpu
@pytest.mark.asyncio
async def test_a_host_hit_on_a_gpu_matches_recompute() -> None:
    from hicache.bootstrap.cache import open_cache
    from hicache.demo.framework import demo_cache_settings

    plan = demo_plan(CFG, page_size=PS, device_pages=48, host_pages=96)
    crt = open_cache(
        plan,
        device="cuda",
        settings=demo_cache_settings(CFG, storage=False),
        device_ownership="framework",
    )
    async with crt:
        server = DemoServer(crt, HybridLM(CFG, device="cuda"))
        result = await compare(server, prompt(448), 320, decode_steps=3)
        assert result.max_abs_diff <= TOL
        assert result.tokens_identical


class Boom(RuntimeError):
    pass


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["before-any-layer", "after-the-load"])
async def test_a_request_failing_mid_restore_returns_every_page_and_pin(
    when: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serving() as server:
        await cache_prefix(server, prompt(384))
        await evict_to(server, "host")

        def fail(_server: DemoServer, _seq: Sequence) -> None:
            raise Boom

        if when == "after-the-load":
            with pytest.raises(Boom):
                await run_cached(server, prompt(448), decode_steps=1, tamper=fail)
        else:
            real = DemoServer.prefill

            def failing(self: DemoServer, *args: object, **kw: object) -> torch.Tensor:
                if kw.get("wait") is not None:
                    raise Boom  # the request dies before its forward pass waits on layer 0
                return real(self, *args, **kw)  # type: ignore[arg-type]

            monkeypatch.setattr(DemoServer, "prefill", failing)
            with pytest.raises(Boom):
                await run_cached(server, prompt(448), decode_steps=1)
            monkeypatch.setattr(DemoServer, "prefill", real)
        assert len(server.rt.engine.device_pins) == 0
        assert len(server.rt.engine.host_pins) == 0
        # The cache is intact: the same prefix restores correctly afterwards (and serving()
        # checks that every page and slot came back).
        await server.evict_all(Tier.DEVICE)
        result = await compare(server, prompt(448), 384, decode_steps=1)
        assert result.max_abs_diff <= TOL
