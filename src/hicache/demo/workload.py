"""The workload of ``hicache demo``: a system prompt, a multi-turn chat and a branch.

- DemoSettings: device, turns, prefix tokens, storage, page size, user/decode tokens, seed.
- TurnResult: one request: its prompt and hit length, both TTFTs, the differences, the load.
- run_demo: warm the system prompt into the host tier, then for every turn (and a branch off the
  system prompt) run a recompute and a host hit of the same prompt, compare them, and back up
  the conversation's new pages (write-through) for the next turn. Returns the JSON document.

Tokens are random ids from a seeded generator (the model is untrained; what matters is that a
cached run is identical to recompute and faster). The storage tier is not wired yet: ``--storage
none`` only; ``storage_hit`` is null.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import attrs
import torch

from hicache.bootstrap.runtime import open_runtime
from hicache.demo.framework import DemoServer, HostEntry, demo_plan
from hicache.demo.harness import (
    LoadFigures,
    cache_prefix,
    differences,
    run_cached,
    run_recompute,
)
from hicache.demo.model import HybridConfig, HybridLM, LayerTimes
from hicache.domain import ConfigError

STORAGE_CHOICES = ("none", "directory", "mooncake")


@attrs.frozen(kw_only=True)
class DemoSettings:
    device: str = "cpu"
    turns: int = 3
    prefix_tokens: int = 2048
    storage: str = "none"
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
        if self.storage != "none":
            raise ConfigError(
                f"--storage {self.storage}: the storage tier is not wired into the demo yet; "
                f"use --storage none (host hits only)"
            )


@attrs.frozen(kw_only=True)
class TurnResult:
    name: str
    prompt_tokens: int
    hit_tokens: int
    recompute_ms: float
    host_hit_ms: float
    max_abs_diff: float
    tokens_identical: bool
    load: LoadFigures
    times: tuple[tuple[int, float, float, float], ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "ttft_ms": {"recompute": self.recompute_ms, "host_hit": self.host_hit_ms},
            "max_abs_diff": self.max_abs_diff,
            "tokens_identical": self.tokens_identical,
            "load_bytes": self.load.bytes,
            "load_copy_ms": round(self.load.copy_s * 1e3, 3),
            "load_waited_ms": round(self.load.waited_s * 1e3, 3),
        }


def _tokens(gen: torch.Generator, vocab: int, n: int) -> list[int]:
    return [int(t) for t in torch.randint(0, vocab, (n,), generator=gen)]


def _plan_sizes(s: DemoSettings) -> tuple[int, int]:
    """Device and host pages for the longest conversation (plus the branch and slack)."""
    longest = s.prefix_tokens + s.turns * (s.user_tokens + s.decode_steps) + s.decode_steps
    pages = -(-longest // s.page_size) + 1
    return 3 * pages, pages * (s.turns + 3)


async def run_demo(
    settings: DemoSettings, *, progress: Callable[[str], None] = lambda _m: None
) -> dict[str, Any]:
    """Run the workload; returns the document ``hicache demo --json`` prints."""
    settings.check()
    threads = torch.get_num_threads()
    if settings.device == "cpu":
        torch.set_num_threads(1)  # one core computes, the engine's copy worker takes the other
    try:
        return await _run(settings, progress)
    finally:
        torch.set_num_threads(threads)


async def _run(settings: DemoSettings, progress: Callable[[str], None]) -> dict[str, Any]:
    cfg = HybridConfig()
    device_pages, host_pages = _plan_sizes(settings)
    plan = demo_plan(
        cfg, page_size=settings.page_size, device_pages=device_pages, host_pages=host_pages
    )
    gen = torch.Generator().manual_seed(settings.seed)
    system = _tokens(gen, cfg.vocab, settings.prefix_tokens)
    results: list[TurnResult] = []
    # The runtime checks the device (a typed error for one that is not there) before the model
    # puts its weights on it.
    async with open_runtime(plan, device=settings.device) as rt:
        server = DemoServer(rt, HybridLM(cfg, device=str(rt.device.device)))
        entries: list[HostEntry] = []
        try:
            progress(f"system prompt: {len(system)} tokens, prefill and back up to host")
            entries.append(await cache_prefix(server, system))
            conversation = list(system)
            requests = [(f"turn {i + 1}", True) for i in range(settings.turns)]
            for name, chat in [*requests, ("branch", False)]:
                user = _tokens(gen, cfg.vocab, settings.user_tokens)
                prompt = [*conversation, *user] if chat else [*system, *user]
                entry = max(
                    (e for e in entries if tuple(prompt[: len(e.tokens)]) == e.tokens),
                    key=lambda e: len(e.tokens),
                )
                hit = len(entry.tokens)
                reference = run_recompute(
                    server, prompt, compare_from=hit, decode_steps=settings.decode_steps
                )
                text_len = len(prompt) + settings.decode_steps
                save_at = (text_len // settings.page_size) * settings.page_size
                times: LayerTimes = []
                # The recompute just left this prompt's K/V and state in the device pages the
                # load may get: overwrite them, so the cached run reads only what it restored.
                server.scribble()
                cached, load, new = await run_cached(
                    server,
                    prompt,
                    entry,
                    decode_steps=settings.decode_steps,
                    save_at=save_at if chat and save_at > hit else None,
                    times=times,
                )
                if new is not None:
                    entries.append(new)
                worst, same = differences(reference, cached)
                if chat:
                    conversation = [*prompt, *cached.tokens[: settings.decode_steps]]
                r = TurnResult(
                    name=name,
                    prompt_tokens=len(prompt),
                    hit_tokens=hit,
                    recompute_ms=round(reference.ttft_s * 1e3, 3),
                    host_hit_ms=round(cached.ttft_s * 1e3, 3),
                    max_abs_diff=worst,
                    tokens_identical=same,
                    load=load,
                    times=tuple((i, a - load.submitted_at, b - load.submitted_at,
                                 c - load.submitted_at) for i, a, b, c in times),
                )
                results.append(r)
                progress(
                    f"{name}: {r.prompt_tokens} tokens, hit {hit}: recompute "
                    f"{r.recompute_ms:.1f} ms, host hit {r.host_hit_ms:.1f} ms, "
                    f"max |diff| {worst:.2e}, tokens {'identical' if same else 'DIFFER'}"
                )
        finally:
            for e in entries:
                server.free_host(e)
    copy = sum(r.load.copy_s for r in results)
    waited = sum(r.load.waited_s for r in results)
    return {
        "device": settings.device,
        "model": cfg.describe(),
        "turns": settings.turns,
        "ttft_ms": {
            "recompute": round(statistics.median(r.recompute_ms for r in results), 3),
            "host_hit": round(statistics.median(r.host_hit_ms for r in results), 3),
            "storage_hit": None,
        },
        "hit_tokens": sum(r.hit_tokens for r in results),
        "max_abs_diff": max(r.max_abs_diff for r in results),
        "tokens_identical": all(r.tokens_identical for r in results),
        "exposed_fraction": round(waited / copy, 4) if copy > 0 else 0.0,
        "runs": [r.as_json() for r in results],
        "_timelines": [{"name": r.name, "layers": r.times} for r in results],
    }


__all__ = ["STORAGE_CHOICES", "DemoSettings", "TurnResult", "run_demo"]
