"""Correctness harness: a cached run of the hybrid model against a full recompute.

- RunResult: what one run of a prompt produced: the logits of the compared positions (the
  positions after the cached prefix, then each decode step), the greedy tokens, TTFT.
- LoadFigures: the host-hit load as its handle saw it: bytes, copy time, time waited.
- run_recompute: prefill the whole prompt, then decode greedily.
- cache_prefix: prefill a page-aligned prefix with a state checkpoint at its end, back it up to
  host, free the device pages; returns the HostEntry (``state_at`` takes the state from another
  boundary: a deliberately wrong entry, for tests).
- run_cached: restore an entry layer by layer (the forward pass waits per layer) and prefill
  only the suffix, then decode; optionally checkpoint and back up a later boundary.
- compare: max abs difference of the compared logits and whether the greedy tokens match.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import attrs
import torch

from hicache.demo.framework import DemoServer, HostEntry, Sequence
from hicache.demo.model import LayerTimes
from hicache.domain import ConfigError
from hicache.engine import LoadHandle


@attrs.frozen
class RunResult:
    logits: torch.Tensor  # (compared positions + decode steps, vocab), on the CPU
    tokens: tuple[int, ...]  # greedy: the first token, then one per decode step
    ttft_s: float


@attrs.frozen
class LoadFigures:
    bytes: int
    copy_s: float
    waited_s: float
    submitted_at: float
    done_at: float


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


async def cache_prefix(
    server: DemoServer, prefix: Seq[int], *, state_at: int | None = None
) -> HostEntry:
    """Prefill ``prefix`` (whole pages), checkpoint its state, back it up, free the device."""
    boundary = len(prefix)
    at = boundary if state_at is None else state_at
    seq = server.new_sequence(boundary)
    slot = server.new_slot()
    try:
        server.prefill(seq, prefix, 0, checkpoints={at: slot})
        return await server.backup(seq, prefix, slot)
    finally:
        server.free(seq)
        server.free_slot(slot)


async def run_cached(
    server: DemoServer,
    prompt: Seq[int],
    entry: HostEntry,
    *,
    decode_steps: int,
    tamper: Callable[[DemoServer, Sequence], None] | None = None,
    save_at: int | None = None,
    times: LayerTimes | None = None,
) -> tuple[RunResult, LoadFigures, HostEntry | None]:
    """Restore ``entry`` from host, prefill the rest of ``prompt``, decode.

    ``tamper`` runs after the load finished and before the suffix (tests corrupt a cache
    there). ``save_at`` (a page boundary past the entry, within prompt + decoded tokens):
    checkpoint the state there during the run and back up that prefix afterwards.
    """
    hit = len(entry.tokens)
    if tuple(prompt[:hit]) != entry.tokens or hit >= len(prompt):
        raise ConfigError(
            f"the entry's {hit} tokens are not a proper prefix of the {len(prompt)}-token prompt"
        )
    if save_at is not None and not (
        hit < save_at <= len(prompt) + decode_steps and save_at % server.page_size == 0
    ):
        raise ConfigError(
            f"save_at={save_at} must be a page boundary in ({hit}, {len(prompt) + decode_steps}]"
        )
    ckpt = server.new_slot() if save_at is not None else None
    checkpoints = {save_at: ckpt} if save_at is not None and ckpt is not None else {}
    seq: Sequence | None = None
    handle: LoadHandle | None = None
    new: HostEntry | None = None
    try:
        t0 = time.perf_counter()
        handle = server.start_restore(entry)
        seq = server.restored_sequence(entry, handle)
        if tamper is not None:
            await handle.wait()
            tamper(server, seq)
        in_prefill = {b: s for b, s in checkpoints.items() if b <= len(prompt)}
        out = server.prefill(
            seq, prompt[hit:], hit, wait=handle, checkpoints=in_prefill, times=times
        )
        first = int(out[-1].argmax())
        ttft = time.perf_counter() - t0
        await handle.wait()
        done = time.perf_counter()
        later = {b: s for b, s in checkpoints.items() if b > len(prompt)}
        logits, tokens = _decode(server, seq, first, len(prompt), decode_steps, later)
        stats = handle.statistics()
        figures = LoadFigures(stats.bytes, stats.copy_s, stats.waited_s, t0, done)
        if save_at is not None and ckpt is not None:
            text = [*prompt, *tokens[:-1]]
            new = await server.backup(seq, text[:save_at], ckpt)
    finally:
        if seq is not None and handle is not None:
            await server.release(seq, handle)
        if ckpt is not None:
            server.free_slot(ckpt)
    return RunResult(torch.cat([out.cpu(), *logits]), tuple(tokens), ttft), figures, new


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


async def compare(
    server: DemoServer,
    prompt: Seq[int],
    prefix_tokens: int,
    *,
    decode_steps: int = 4,
    tamper: Callable[[DemoServer, Sequence], None] | None = None,
    state_at: int | None = None,
) -> Comparison:
    """Recompute ``prompt``; cache its first ``prefix_tokens`` (whole pages) on host, scribble
    over the device, restore and prefill the rest; compare both runs."""
    reference = run_recompute(
        server, prompt, compare_from=prefix_tokens, decode_steps=decode_steps
    )
    entry = await cache_prefix(server, prompt[:prefix_tokens], state_at=state_at)
    try:
        server.scribble()
        cached, load, _ = await run_cached(
            server, prompt, entry, decode_steps=decode_steps, tamper=tamper
        )
    finally:
        server.free_host(entry)
    worst, same = differences(reference, cached)
    return Comparison(reference, cached, load, prefix_tokens, worst, same)


__all__ = [
    "Comparison",
    "LoadFigures",
    "RunResult",
    "cache_prefix",
    "compare",
    "differences",
    "run_cached",
    "run_recompute",
]
