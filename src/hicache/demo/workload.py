"""The workload of ``hicache demo``: a system prompt, a multi-turn chat and a branch.

- DemoSettings: device, turns, prefix tokens, storage, page size, user/decode tokens, seed.
- TurnResult: one request: its prompt and hit length, the TTFTs, the differences, the loads.
- open_demo_store: the store of ``--storage``: a DirectoryStore in a temporary folder (removed
  at close), Mooncake (``open_named_store("mooncake", {})``: a local master and storage node
  started and stopped with it), or none.
- run_demo: cache the system prompt, then for every turn (and a branch off the system prompt)
  run a recompute, a host hit (device evicted) and, with a store, a storage hit (device and host
  evicted: prefetch, then load) of the same prompt; compare each with the recompute; insert the
  conversation's new pages for the next turn. Returns the JSON document (with
  ``served_tokens``: what the matches served per tier, as the framework saw them). A
  HiCacheMetrics passed in exports the demo's cache (``hicache demo --metrics``).

Tokens are random ids from a seeded generator (the model is untrained; what matters is that a
cached run is identical to recompute and faster).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from typing import Any

import attrs
import torch

from hicache.bootstrap.cache import open_cache
from hicache.demo.framework import DemoServer, demo_cache_settings, demo_plan
from hicache.demo.harness import (
    LoadFigures,
    RunResult,
    cache_prefix,
    differences,
    evict_to,
    run_cached,
    run_recompute,
)
from hicache.demo.model import HybridConfig, HybridLM, LayerKind, LayerTimes
from hicache.domain import ConfigError
from hicache.domain.storage import Store
from hicache.metrics import HiCacheMetrics

STORAGE_CHOICES = ("none", "directory", "mooncake")


@attrs.frozen(kw_only=True)
class DemoSettings:
    device: str = "cpu"
    turns: int = 3
    prefix_tokens: int = 2048
    storage: str = "directory"
    page_size: int = 64
    user_tokens: int = 96
    decode_steps: int = 4
    seed: int = 7

    def check(self) -> None:
        for name in ("turns", "prefix_tokens", "page_size", "user_tokens", "decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        if self.prefix_tokens % self.page_size:
            raise ConfigError(
                f"--prefix-tokens {self.prefix_tokens} must be a whole number of pages of "
                f"{self.page_size} tokens"
            )
        if self.prefix_tokens > 16384 or self.turns > 32:
            raise ConfigError(
                f"the demo runs at most 16384 prefix tokens and 32 turns, got "
                f"{self.prefix_tokens} and {self.turns}"
            )
        if self.storage not in STORAGE_CHOICES:
            raise ConfigError(
                f"--storage {self.storage!r}: expected one of {', '.join(STORAGE_CHOICES)}"
            )


@attrs.frozen(kw_only=True)
class TurnResult:
    name: str
    prompt_tokens: int
    hit_tokens: int
    recompute_ms: float
    host_hit_ms: float
    storage_hit_ms: float | None
    max_abs_diff: float
    tokens_identical: bool
    loads: tuple[LoadFigures, ...]
    timelines: tuple[dict[str, Any], ...]  # per cached run, for --plot (see _timeline)

    def as_json(self) -> dict[str, Any]:
        copy = sum(f.copy_s for f in self.loads)
        return {
            "name": self.name,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "ttft_ms": {
                "recompute": self.recompute_ms,
                "host_hit": self.host_hit_ms,
                "storage_hit": self.storage_hit_ms,
            },
            "max_abs_diff": self.max_abs_diff,
            "tokens_identical": self.tokens_identical,
            "load_bytes": sum(f.bytes for f in self.loads),
            "load_copy_ms": round(copy * 1e3, 3),
            "load_waited_ms": round(sum(f.waited_s for f in self.loads) * 1e3, 3),
            "exposed_fraction": _exposed(self.loads),
        }


def _exposed(loads: Seq[LoadFigures]) -> float:
    """The share of the loads' copy time the forward pass waited for, in [0, 1]."""
    copy = sum(f.copy_s for f in loads)
    return round(sum(f.exposed_s for f in loads) / copy, 4) if copy > 0 else 0.0


@contextlib.contextmanager
def open_demo_store(kind: str) -> Iterator[Store | None]:
    """The store of ``--storage kind``, closed (and its temporary folder removed) on exit."""
    if kind == "none":
        yield None
        return
    from hicache.bootstrap.storage import open_named_store

    if kind == "directory":
        with tempfile.TemporaryDirectory(prefix="hicache-demo-") as root:
            store = open_named_store("directory", {"root": root})
            try:
                yield store
            finally:
                store.close()
        return
    if kind == "mooncake":
        store = open_named_store("mooncake", {})
        try:
            yield store
        finally:
            store.close()
        return
    raise ConfigError(f"--storage {kind!r}: expected one of {', '.join(STORAGE_CHOICES)}")


def _tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=gen)]


def _plan_sizes(s: DemoSettings) -> tuple[int, int]:
    """Device and host pages for the longest conversation (plus the branch and slack)."""
    longest = s.prefix_tokens + s.turns * (s.user_tokens + s.decode_steps) + s.decode_steps
    pages = -(-longest // s.page_size) + 1
    return 3 * pages, pages * (s.turns + 3)


async def run_demo(
    settings: DemoSettings,
    *,
    progress: Callable[[str], None] = lambda _m: None,
    metrics: HiCacheMetrics | None = None,
) -> dict[str, Any]:
    """Run the workload; returns the document ``hicache demo --json`` prints. With ``metrics``,
    the demo's cache is added to it (``cache="demo"``) for the run, so a scrape (during or
    after it) reads the cache's statistics."""
    settings.check()
    threads = torch.get_num_threads()
    if settings.device == "cpu":
        torch.set_num_threads(1)  # one core computes, the engine's copy worker takes the other
    try:
        with open_demo_store(settings.storage) as store:
            return await _run(settings, store, progress, metrics)
    finally:
        torch.set_num_threads(threads)


KIND_LABELS = {LayerKind.FULL: "full", LayerKind.SLIDING: "sliding", LayerKind.DELTANET: "state"}


def _timeline(
    label: str,
    run: tuple[RunResult, LoadFigures],
    times: LayerTimes,
    loaded: Seq[tuple[int, float]],
    marks: dict[str, float],
) -> dict[str, Any]:
    """One cached run for the --plot timeline: times in seconds since its match (``layers``:
    (layer, wait start, wait end, compute end); ``loaded``: (layer, its load complete);
    ``begun``: the match and the load call returned), the prefetch before the match and the
    time to first token since the request began."""
    result, figures = run
    return {
        "label": label,
        "prefetch_s": figures.prefetch_s,
        "ttft_s": result.ttft_s,
        "begun_s": marks["begun"],
        "layers": tuple(times),
        "loaded": tuple(loaded),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


async def _run(
    settings: DemoSettings,
    store: Store | None,
    progress: Callable[[str], None],
    metrics: HiCacheMetrics | None,
) -> dict[str, Any]:
    cfg = HybridConfig()
    device_pages, host_pages = _plan_sizes(settings)
    plan = demo_plan(
        cfg,
        page_size=settings.page_size,
        device_pages=device_pages,
        host_pages=host_pages,
        device_slots=64,
        host_slots=128,
    )
    gen = torch.Generator().manual_seed(settings.seed)
    system = _tokens(gen, cfg.vocab, settings.prefix_tokens)
    results: list[TurnResult] = []
    steps = settings.decode_steps
    # The runtime checks the device (a typed error for one that is not there) before the model
    # puts its weights on it.
    crt = open_cache(
        plan,
        device=settings.device,
        store=store,
        settings=demo_cache_settings(cfg, storage=store is not None),
        device_ownership="framework",
    )
    async with crt:
        if metrics is not None:
            metrics.add_cache(crt.cache, name="demo")
        server = DemoServer(crt, HybridLM(cfg, device=str(crt.runtime.device.device)))
        where = "host and storage" if store is not None else "host"
        progress(f"system prompt: {len(system)} tokens, prefill and insert (to {where})")
        await cache_prefix(server, system)
        conversation = list(system)
        requests = [(f"turn {i + 1}", True) for i in range(settings.turns)]
        for name, chat in [*requests, ("branch", False)]:
            user = _tokens(gen, cfg.vocab, settings.user_tokens)
            prompt = [*conversation, *user] if chat else [*system, *user]
            reference = run_recompute(server, prompt, compare_from=0, decode_steps=steps)
            runs: list[tuple[RunResult, LoadFigures]] = []
            timelines: list[dict[str, Any]] = []
            times: LayerTimes = []
            loaded: list[tuple[int, float]] = []
            marks: dict[str, float] = {}
            # The recompute left this prompt's K/V and state in device pages a load may get:
            # evict_to scribbles over the device, so a cached run reads only what it restored.
            await evict_to(server, "host")
            if store is not None:
                # An earlier storage hit evicted the host tier and prefetched only its own
                # prompt's pages: the branch's system prompt then has its KV on host but its
                # state checkpoint on storage only. The prefetch brings just that checkpoint
                # back to host (the KV pages on host are kept), untimed.
                await server.warm_host(prompt)
            runs.append(
                await run_cached(
                    server,
                    prompt,
                    decode_steps=steps,
                    insert=store is None,
                    times=times,
                    loaded=loaded,
                    marks=marks,
                )
            )
            timelines.append(_timeline("host hit", runs[-1], times, loaded, marks))
            if store is not None:
                await evict_to(server, "storage")
                times, loaded, marks = [], [], {}
                runs.append(
                    await run_cached(
                        server,
                        prompt,
                        decode_steps=steps,
                        prefetch=True,
                        times=times,
                        loaded=loaded,
                        marks=marks,
                    )
                )
                timelines.append(_timeline("storage hit", runs[-1], times, loaded, marks))
            await server.cache.wait_idle()
            hit = runs[0][0].hit
            worst, same = 0.0, True
            for run, _ in runs:
                if run.hit != hit:
                    raise ConfigError(
                        f"{name}: the storage hit restored {run.hit} tokens, the host hit {hit}"
                    )
                ref = RunResult(reference.logits[hit:], reference.tokens, reference.ttft_s)
                w, s_ = differences(ref, run)
                worst, same = max(worst, w), same and s_
            if chat:
                conversation = [*prompt, *runs[0][0].tokens[:steps]]
            r = TurnResult(
                name=name,
                prompt_tokens=len(prompt),
                hit_tokens=hit,
                recompute_ms=_ms(reference.ttft_s),
                host_hit_ms=_ms(runs[0][0].ttft_s),
                storage_hit_ms=_ms(runs[1][0].ttft_s) if len(runs) > 1 else None,
                max_abs_diff=worst,
                tokens_identical=same,
                loads=tuple(f for _, f in runs),
                timelines=tuple(timelines),
            )
            results.append(r)
            storage = (
                f", storage hit {r.storage_hit_ms:.1f} ms" if r.storage_hit_ms is not None else ""
            )
            progress(
                f"{name}: {r.prompt_tokens} tokens, hit {hit}: recompute "
                f"{r.recompute_ms:.1f} ms, host hit {r.host_hit_ms:.1f} ms{storage}, "
                f"max |diff| {worst:.2e}, tokens {'identical' if same else 'DIFFER'}"
            )
    storage_ms = [r.storage_hit_ms for r in results if r.storage_hit_ms is not None]
    return {
        "device": settings.device,
        "model": cfg.describe(),
        "turns": settings.turns,
        "storage": settings.storage,
        "ttft_ms": {
            "recompute": round(statistics.median(r.recompute_ms for r in results), 3),
            "host_hit": round(statistics.median(r.host_hit_ms for r in results), 3),
            "storage_hit": round(statistics.median(storage_ms), 3) if storage_ms else None,
        },
        "hit_tokens": sum(r.hit_tokens for r in results),
        "served_tokens": dict(zip(("device", "host", "storage"), server.served, strict=True)),
        "max_abs_diff": max(r.max_abs_diff for r in results),
        "tokens_identical": all(r.tokens_identical for r in results),
        "exposed_fraction": _exposed([f for r in results for f in r.loads]),
        "runs": [r.as_json() for r in results],
        "_timelines": [
            {
                "name": r.name,
                "kinds": [KIND_LABELS[k] for k in cfg.pattern],
                "runs": list(r.timelines),
            }
            for r in results
        ],
    }


__all__ = ["STORAGE_CHOICES", "DemoSettings", "TurnResult", "open_demo_store", "run_demo"]
