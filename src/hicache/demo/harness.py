"""Correctness harness: a cached run of the hybrid model against a full recompute.

- RunResult: what one run of a prompt produced: the logits of the compared positions (the
  positions after the cached prefix, then each decode step), the greedy tokens, TTFT, the hit.
- LoadFigures: a cached run's load as the forward pass saw it: bytes, the copy's stream time,
  the time the forward pass waited in its per-layer waits, the prefetch time.
- run_recompute: prefill the whole prompt in fresh pages, then decode greedily; nothing cached.
- cache_prefix: prefill a prefix with the face's state checkpoints and insert it (device, and
  host and storage by write-through); ``state_at`` takes the end checkpoint's state from another
  token: a deliberately wrong cache entry, for tests.
- run_cached: (after an optional prefetch from storage) match, load layer by layer while the
  forward pass of the suffix waits per layer, decode, insert what it computed.
- compare: recompute, cache the prefix, evict it from the device (and the host for
  ``tier="storage"``), scribble over the device, run cached; the differences.
- differences: max abs difference of the compared logits and whether the greedy tokens match.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import attrs
import torch

from hicache.demo.framework import DemoServer, Sequence
from hicache.demo.model import LayerTimes
from hicache.domain import ConfigError, Tier


@attrs.frozen
class RunResult:
    logits: torch.Tensor  # (compared positions + decode steps, vocab), on the CPU
    tokens: tuple[int, ...]  # greedy: the first token, then one per decode step
    ttft_s: float
    hit: int = 0  # tokens restored from the cache


@attrs.frozen
class LoadFigures:
    bytes: int
    copy_s: float  # the stream time of the load's copies (LoadHandle statistics)
    waited_s: float  # the forward pass's per-layer waits (before each layer read its cache)
    prefetch_s: float  # storage -> host before the match (0 for a host hit)

    @property
    def exposed_s(self) -> float:
        """The part of the copy time the forward pass waited for: a wait can also cover the
        copy's start-up (the copy thread not scheduled yet), which is not copy time."""
        return min(self.waited_s, self.copy_s)


def _decode(
    server: DemoServer,
    seq: Sequence,
    first: int,
    position: int,
    steps: int,
    checkpoints: dict[int, int],
) -> tuple[list[torch.Tensor], list[int]]:
    logits: list[torch.Tensor] = []
    tokens = [first]
    for _ in range(steps):
        cks = {b: s for b, s in checkpoints.items() if b == position + 1}
        out = server.prefill(seq, [tokens[-1]], position, checkpoints=cks)
        logits.append(out[-1:].cpu())
        tokens.append(int(out[-1].argmax()))
        position += 1
    return logits, tokens


def run_recompute(
    server: DemoServer, prompt: Seq[int], *, compare_from: int, decode_steps: int
) -> RunResult:
    """Full prefill of ``prompt``; logits from position ``compare_from`` on, then decode."""
    seq = server.new_sequence(len(prompt) + decode_steps)
    try:
        t0 = time.perf_counter()
        out = server.prefill(seq, prompt, 0)
        first = int(out[-1].argmax())
        ttft = time.perf_counter() - t0
        logits, tokens = _decode(server, seq, first, len(prompt), decode_steps, {})
    finally:
        server.free(seq)
    return RunResult(torch.cat([out[compare_from:].cpu(), *logits]), tuple(tokens), ttft)


async def cache_prefix(server: DemoServer, prefix: Seq[int], *, state_at: int | None = None) -> int:
    """Prefill ``prefix`` with the face's checkpoints and insert it; returns its hit (tokens
    restored from the cache). Waits until the write-throughs (host, storage) finished."""
    req = await server.begin(prefix, len(prefix))
    try:
        cks = dict(req.checkpoints)
        if state_at is not None:
            end = max(cks)
            if not req.hit < state_at < end:
                raise ConfigError(f"state_at={state_at} must lie in ({req.hit}, {end})")
            cks = {b: s for b, s in cks.items() if b != end} | {state_at: cks[end]}
        server.prefill(req.seq, prefix[req.hit :], req.hit, wait=req.load, checkpoints=cks)
    except BaseException:
        await server.abort(req)
        raise
    await server.finish(req, prefix)
    await server.cache.wait_idle()
    return req.hit


async def run_cached(
    server: DemoServer,
    prompt: Seq[int],
    *,
    decode_steps: int,
    prefetch: bool = False,
    tamper: Callable[[DemoServer, Sequence], None] | None = None,
    insert: bool = True,
    times: LayerTimes | None = None,
    loaded: list[tuple[int, float]] | None = None,
    marks: dict[str, float] | None = None,
) -> tuple[RunResult, LoadFigures]:
    """Serve ``prompt`` from the cache: prefetch (storage -> host) if asked, match, load layer
    by layer, prefill the rest with per-layer waits, decode; insert what it computed.

    TTFT runs from the prefetch (or the match) to the first token. ``tamper`` runs after the
    load finished and before the suffix (tests corrupt a cache there). ``times`` receives the
    forward pass's (layer, wait start, wait end, compute end) and ``loaded`` each layer's
    (layer, time its load was complete), in seconds since the match; ``marks["begun"]`` the
    time ``begin`` returned (match, device pages allocated, load submitted).
    """
    computed = len(prompt) + decode_steps
    t0 = time.perf_counter()
    if prefetch:
        await server.prefetch(prompt)
    t_match = time.perf_counter()
    req = await server.begin(prompt, computed)
    if marks is not None:
        marks["begun"] = time.perf_counter() - t_match
    watcher: threading.Thread | None = None
    ready: list[tuple[int, float]] = []
    if loaded is not None and req.load.handle is not None:
        # A thread that sees each layer's load complete (for the --plot timeline only).
        layers = server.model.config.layers
        load = req.load

        def watch() -> None:
            for i in range(layers):
                load.wait_model_layer(i)
                ready.append((i, time.perf_counter() - t_match))

        watcher = threading.Thread(target=watch, name="demo-load-watch", daemon=True)
        watcher.start()
    try:
        if tamper is not None:
            await req.load.wait()
            tamper(server, req.seq)
        hit = req.hit
        layer_times: LayerTimes = []
        cks = dict(req.checkpoints)
        in_prefill = {b: s for b, s in cks.items() if b <= len(prompt)}
        out = server.prefill(
            req.seq, prompt[hit:], hit, wait=req.load, checkpoints=in_prefill, times=layer_times
        )
        first = int(out[-1].argmax())
        ttft = time.perf_counter() - t0
        await req.load.wait()
        if watcher is not None:
            watcher.join()
            if loaded is not None:
                loaded.extend(ready)
        later = {b: s for b, s in cks.items() if b > len(prompt)}
        logits, tokens = _decode(server, req.seq, first, len(prompt), decode_steps, later)
        handle = req.load.handle
        stats = handle.statistics() if handle is not None else None
        figures = LoadFigures(
            stats.bytes if stats is not None else 0,
            stats.copy_s if stats is not None else 0.0,
            sum(t1 - w0 for _, w0, t1, _ in layer_times),
            t_match - t0 if prefetch else 0.0,
        )
        if times is not None:
            times.extend((i, a - t_match, b - t_match, c - t_match) for i, a, b, c in layer_times)
    except BaseException:
        await server.abort(req)
        raise
    if insert:
        await server.finish(req, [*prompt, *tokens[:decode_steps]])
    else:
        await server.abort(req)
    return RunResult(torch.cat([out.cpu(), *logits]), tuple(tokens), ttft, hit), figures


@attrs.frozen
class Comparison:
    recompute: RunResult
    cached: RunResult
    load: LoadFigures
    hit_tokens: int
    max_abs_diff: float
    tokens_identical: bool


def differences(a: RunResult, b: RunResult) -> tuple[float, bool]:
    """Max abs difference of the logits (inf when shapes differ or a NaN shows), same tokens."""
    if a.logits.shape != b.logits.shape:
        return float("inf"), a.tokens == b.tokens
    diff = (a.logits - b.logits).abs()
    worst = float("inf") if bool(torch.isnan(diff).any()) else float(diff.max())
    return worst, a.tokens == b.tokens


async def evict_to(server: DemoServer, tier: str) -> None:
    """Leave cached pages only on ``tier`` ("host" or "storage") and scribble over the device."""
    if tier not in ("host", "storage"):
        raise ConfigError(f"tier {tier!r}: expected 'host' or 'storage'")
    await server.evict_all(Tier.DEVICE)
    if tier == "storage":
        await server.evict_all(Tier.HOST)
    server.scribble()


async def compare(
    server: DemoServer,
    prompt: Seq[int],
    prefix_tokens: int,
    *,
    decode_steps: int = 4,
    tier: str = "host",
    tamper: Callable[[DemoServer, Sequence], None] | None = None,
    state_at: int | None = None,
) -> Comparison:
    """Recompute ``prompt``; cache its first ``prefix_tokens`` (whole pages), keep them only on
    ``tier``, scribble over the device, serve the prompt from the cache; compare both runs."""
    if prefix_tokens % server.page_size or not 0 < prefix_tokens < len(prompt):
        raise ConfigError(
            f"prefix_tokens={prefix_tokens} must be a whole number of pages shorter than the "
            f"{len(prompt)}-token prompt"
        )
    reference = run_recompute(server, prompt, compare_from=prefix_tokens, decode_steps=decode_steps)
    await cache_prefix(server, prompt[:prefix_tokens], state_at=state_at)
    await evict_to(server, tier)
    cached, load = await run_cached(
        server,
        prompt,
        decode_steps=decode_steps,
        prefetch=tier == "storage",
        tamper=tamper,
        insert=False,
    )
    if cached.hit != prefix_tokens:
        raise ConfigError(f"the cache restored {cached.hit} tokens, expected {prefix_tokens}")
    worst, same = differences(reference, cached)
    return Comparison(reference, cached, load, prefix_tokens, worst, same)


__all__ = [
    "Comparison",
    "LoadFigures",
    "RunResult",
    "cache_prefix",
    "compare",
    "differences",
    "evict_to",
    "run_cached",
    "run_recompute",
]
