"""A small hybrid causal language model whose caches live in hicache's device pools.

- HybridConfig: the model's sizes and its layer pattern (full, sliding-window, Gated DeltaNet).
- LayerKind: FULL (GQA attention + K-only indexer), SLIDING (windowed GQA), DELTANET.
- CacheTensors: the per-layer device tensors the model reads and writes (a port the framework
  fills from its device pools): KV rows, indexer K rows, state slots.
- SeqCache: one sequence's view of those tensors: the pool row of every token position (full
  and sliding pools) and its live recurrent-state slot.
- HybridLM: deterministic seeded weights (fp32) and ``forward``: prefill or decode of a chunk of
  tokens starting at any position, with a per-layer ``wait(layer)`` before a layer reads its
  cache and state checkpoints at chosen token boundaries.

Every cache influences the logits: full attention reads K/V of all earlier tokens and an
indexer bias from the cached indexer K; sliding layers read the last ``window`` tokens; the
Gated DeltaNet layers read their conv state (the last K-1 inputs) and temporal state (Dk x Dv per
head). This module is the "serving framework's model"; it imports torch and never hicache's
engine.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from hicache.domain import ConfigError

Tensor = torch.Tensor


class LayerKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding"
    DELTANET = "deltanet"


DEFAULT_PATTERN = (
    LayerKind.SLIDING,
    LayerKind.FULL,
    LayerKind.DELTANET,
    LayerKind.SLIDING,
    LayerKind.FULL,
    LayerKind.SLIDING,
    LayerKind.DELTANET,
    LayerKind.FULL,
)


@attrs.frozen(kw_only=True)
class HybridConfig:
    """Sizes of the demo model. Attention: GQA ``heads`` over ``kv_heads``; DeltaNet: equal heads."""

    vocab: int = 512
    hidden: int = 256
    mlp: int = 1024
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    window: int = 256
    index_heads: int = 4
    index_dim: int = 32
    delta_heads: int = 4
    delta_dim: int = 32
    conv_kernel: int = 4
    rope_base: float = 10000.0
    pattern: tuple[LayerKind, ...] = DEFAULT_PATTERN
    seed: int = 1234

    @property
    def layers(self) -> int:
        return len(self.pattern)

    @property
    def conv_dim(self) -> int:
        return 3 * self.delta_heads * self.delta_dim

    def layers_of(self, kind: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.pattern) if k is kind)

    def describe(self) -> str:
        counts = {k: len(self.layers_of(k)) for k in LayerKind}
        return (
            f"hybrid-{self.layers}L-{self.hidden}d: {counts[LayerKind.FULL]} full (GQA "
            f"{self.heads}/{self.kv_heads} x {self.head_dim}, indexer), "
            f"{counts[LayerKind.SLIDING]} sliding (window {self.window}), "
            f"{counts[LayerKind.DELTANET]} Gated DeltaNet ({self.delta_heads} x {self.delta_dim}, "
            f"conv {self.conv_kernel}), vocab {self.vocab}, fp32"
        )


@attrs.frozen(kw_only=True)
class CacheTensors:
    """Per model layer, the device tensors the model uses (views of the framework's pools).

    ``kv[layer] = (k, v)``: (rows, kv_heads, head_dim) for full and sliding layers;
    ``index_k[layer]``: (rows, 1, index_dim) for full layers; ``state[layer] = (conv, temporal)``:
    (slots, conv_dim, kernel-1) and (slots, heads, dk, dv) for DeltaNet layers.
    """

    kv: Mapping[int, tuple[Tensor, Tensor]]
    index_k: Mapping[int, Tensor]
    state: Mapping[int, tuple[Tensor, Tensor]]


@attrs.frozen(kw_only=True)
class SeqCache:
    """One sequence: pool rows per token position, and its live state slot.

    ``full_rows[p]`` is the KV/indexer row of position p; ``swa_rows[p]`` its sliding-window row
    (-1 where the framework holds no page: only the window before a position is ever read).
    """

    full_rows: Tensor
    swa_rows: Tensor
    slot: int
    # A restored sequence's state checkpoint: read (never written) by its first chunk's
    # DeltaNet layers, after their wait; the cache keeps that slot, the live state is ``slot``.
    state_from: int | None = None


Wait = Callable[[int], None]
# Queries per attention block, aligned to absolute positions. 64 keeps every block under the
# CPU flash kernel's 192-query threshold (one split size for all blocks), so a suffix run that
# starts at a multiple of 64 computes bit for bit what a full recompute computes.
QUERY_BLOCK = 64
LayerTimes = list[tuple[int, float, float, float]]  # (layer, wait start, wait end, compute end)


def _rms(x: Tensor, w: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rope(x: Tensor, positions: Tensor, base: float) -> Tensor:
    """Rotary embedding over the last dim of (T, H, D) at absolute ``positions``."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


class HybridLM:
    """The demo model: weights from a seeded generator; caches only through ``CacheTensors``."""

    def __init__(self, config: HybridConfig | None = None, *, device: str = "cpu") -> None:
        self.config = cfg = config or HybridConfig()
        self.device = torch.device(device)
        if cfg.heads % cfg.kv_heads:
            raise ConfigError(f"heads {cfg.heads} must be a multiple of kv_heads {cfg.kv_heads}")
        gen = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, scale: float | None = None) -> Tensor:
            s = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            return torch.randn(*shape, generator=gen) * s

        d = cfg.hidden
        self.embed = w(cfg.vocab, d, scale=1.0)
        self.head = w(d, cfg.vocab)
        self.final_norm = torch.ones(d)
        self.layers: list[dict[str, Tensor]] = []
        for kind in cfg.pattern:
            p = {
                "norm1": torch.ones(d),
                "norm2": torch.ones(d),
                "gate": w(d, cfg.mlp),
                "up": w(d, cfg.mlp),
                "down": w(cfg.mlp, d),
            }
            if kind is LayerKind.DELTANET:
                hd = cfg.delta_heads * cfg.delta_dim
                p |= {
                    "qkv": w(d, cfg.conv_dim),
                    "conv": w(cfg.conv_dim, cfg.conv_kernel, scale=0.5),
                    "beta": w(d, cfg.delta_heads),
                    "decay": w(d, cfg.delta_heads),
                    "z": w(d, hd),
                    "o": w(hd, d),
                }
            else:
                p |= {
                    "q": w(d, cfg.heads * cfg.head_dim),
                    "k": w(d, cfg.kv_heads * cfg.head_dim),
                    "v": w(d, cfg.kv_heads * cfg.head_dim),
                    "o": w(cfg.heads * cfg.head_dim, d),
                }
                if kind is LayerKind.FULL:
                    p |= {
                        "iq": w(d, cfg.index_heads * cfg.index_dim),
                        "ik": w(d, cfg.index_dim),
                        "iw": w(d, cfg.index_heads),
                    }
            self.layers.append({k: t.to(self.device) for k, t in p.items()})
        self.embed, self.head = self.embed.to(self.device), self.head.to(self.device)
        self.final_norm = self.final_norm.to(self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: Sequence[int] | Tensor,
        start: int,
        seq: SeqCache,
        caches: CacheTensors,
        *,
        wait: Wait | None = None,
        checkpoints: Mapping[int, int] | None = None,
        times: LayerTimes | None = None,
    ) -> Tensor:
        """Logits (T, vocab) of ``tokens`` at positions ``start..start+T-1``.

        Writes the chunk's K/V and indexer K into the pools and advances the state in
        ``seq.slot`` (zeroed first when ``start == 0``; read from ``seq.state_from`` when
        given). Before layer i reads its cache it calls
        ``wait(i)``. ``checkpoints`` maps a token boundary b (start < b <= start+T) to a state
        slot that receives the recurrent state after token b-1.
        """
        cfg = self.config
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.device)
        n = int(ids.shape[0])
        if n == 0:
            raise ConfigError("forward needs at least one token, got none")
        end = start + n
        if end > seq.full_rows.shape[0]:
            raise ConfigError(
                f"positions up to {end} need pool rows, the sequence has {seq.full_rows.shape[0]}"
            )
        cks = dict(checkpoints or {})
        bad = [b for b in cks if not start < b <= end]
        if bad:
            raise ConfigError(f"checkpoint boundaries {bad} are outside ({start}, {end}]")
        positions = torch.arange(start, end, device=self.device)
        x = self.embed[ids]
        for i, (kind, p) in enumerate(zip(cfg.pattern, self.layers, strict=True)):
            t0 = time.perf_counter()
            if wait is not None:
                wait(i)
            t1 = time.perf_counter()
            h = _rms(x, p["norm1"])
            if kind is LayerKind.DELTANET:
                conv, temporal = caches.state[i]
                src = seq.state_from
                h = self._deltanet(h, p, conv, temporal, seq.slot, start, cks, src)
            else:
                k_buf, v_buf = caches.kv[i]
                rows = seq.full_rows if kind is LayerKind.FULL else seq.swa_rows
                idx = caches.index_k.get(i) if kind is LayerKind.FULL else None
                h = self._attention(h, p, k_buf, v_buf, idx, rows, positions, kind)
            x = x + h
            g = _rms(x, p["norm2"])
            x = x + (F.silu(g @ p["gate"]) * (g @ p["up"])) @ p["down"]
            if times is not None:
                times.append((i, t0, t1, time.perf_counter()))
        return _rms(x, self.final_norm) @ self.head

    def _attention(
        self,
        h: Tensor,
        p: dict[str, Tensor],
        k_buf: Tensor,
        v_buf: Tensor,
        index_k: Tensor | None,
        rows: Tensor,
        positions: Tensor,
        kind: LayerKind,
    ) -> Tensor:
        cfg = self.config
        n = h.shape[0]
        start, end = int(positions[0]), int(positions[-1]) + 1
        q = _rope((h @ p["q"]).view(n, cfg.heads, cfg.head_dim), positions, cfg.rope_base)
        k = _rope((h @ p["k"]).view(n, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_base)
        v = (h @ p["v"]).view(n, cfg.kv_heads, cfg.head_dim)
        own = rows[start:end]
        k_buf[own] = k
        v_buf[own] = v
        if index_k is not None:
            index_k[own] = (h @ p["ik"]).view(n, 1, cfg.index_dim)
        rep = cfg.heads // cfg.kv_heads
        out = torch.empty_like(q)
        # Query blocks aligned to absolute positions, each with the key range of its whole
        # block: a suffix run then sums exactly the keys a full recompute sums, in its order.
        for block in range(start - start % QUERY_BLOCK, end, QUERY_BLOCK):
            lo, hi = max(start, block) - start, min(end, block + QUERY_BLOCK) - start
            pos = positions[lo:hi]
            first = 0 if kind is LayerKind.FULL else max(0, block - cfg.window + 1)
            last = start + hi
            key_rows = rows[first:last]
            key_pos = torch.arange(first, last, device=h.device)
            allowed = key_pos[None, :] <= pos[:, None]
            if kind is LayerKind.SLIDING:
                allowed &= key_pos[None, :] > pos[:, None] - cfg.window
            missing = key_rows < 0  # outside every window: masked, read as zeros
            if bool((missing & allowed.any(dim=0)).any()):
                raise ConfigError(
                    f"positions {first}..{last - 1} need sliding-window pages the sequence lacks"
                )
            safe = key_rows.clamp(min=0)
            keys = k_buf[safe].masked_fill(missing[:, None, None], 0.0)
            vals = v_buf[safe].masked_fill(missing[:, None, None], 0.0)
            keys = keys.repeat_interleave(rep, dim=1).transpose(0, 1)
            vals = vals.repeat_interleave(rep, dim=1).transpose(0, 1)
            bias = torch.zeros(allowed.shape, device=h.device)
            if index_k is not None:
                bias = self._index_bias(h[lo:hi], p, index_k[key_rows][:, 0])
            bias = bias.masked_fill(~allowed, float("-inf"))
            out[lo:hi] = F.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), keys, vals, attn_mask=bias
            ).transpose(0, 1)
        return out.reshape(n, -1) @ p["o"]

    def _index_bias(self, h: Tensor, p: dict[str, Tensor], keys: Tensor) -> Tensor:
        """Lightning-indexer style score per (query, key): sum_h w_h * relu(q_h . k)."""
        cfg = self.config
        iq = (h @ p["iq"]).view(h.shape[0], cfg.index_heads, cfg.index_dim)
        weights = torch.sigmoid(h @ p["iw"])  # (T, index_heads)
        dots = torch.relu(torch.einsum("qhd,kd->qhk", iq, keys)) / math.sqrt(cfg.index_dim)
        return torch.einsum("qh,qhk->qk", weights, dots)

    def _deltanet(
        self,
        h: Tensor,
        p: dict[str, Tensor],
        conv_buf: Tensor,
        temporal_buf: Tensor,
        slot: int,
        start: int,
        checkpoints: Mapping[int, int],
        source: int | None = None,
    ) -> Tensor:
        """Gated DeltaNet: causal short conv over q/k/v, then the gated delta rule per token."""
        cfg = self.config
        n = h.shape[0]
        km1 = cfg.conv_kernel - 1
        if start == 0:
            conv_buf[slot].zero_()
            temporal_buf[slot].zero_()
        elif source is not None and source != slot:
            conv_buf[slot] = conv_buf[source]
            temporal_buf[slot] = temporal_buf[source]
        raw = h @ p["qkv"]  # (T, conv_dim)
        ext = torch.cat([conv_buf[slot].T, raw], dim=0)  # positions start-K+1 .. end-1
        mixed = p["conv"][:, 0] * ext[0:n]
        for j in range(1, cfg.conv_kernel):
            mixed = mixed + p["conv"][:, j] * ext[j : j + n]
        mixed = F.silu(mixed)
        hd = cfg.delta_heads * cfg.delta_dim
        q = F.normalize(mixed[:, :hd].view(n, cfg.delta_heads, cfg.delta_dim), dim=-1)
        k = F.normalize(mixed[:, hd : 2 * hd].view(n, cfg.delta_heads, cfg.delta_dim), dim=-1)
        v = mixed[:, 2 * hd :].view(n, cfg.delta_heads, cfg.delta_dim)
        beta = torch.sigmoid(h @ p["beta"])  # (T, H) write strength
        alpha = torch.sigmoid(h @ p["decay"] + 3.0)  # (T, H) decay in (0, 1)
        state = temporal_buf[slot].clone()  # (H, Dk, Dv)
        outs = torch.empty(n, cfg.delta_heads, cfg.delta_dim, device=h.device)
        kcol, qrow = k.unsqueeze(-1), q.unsqueeze(-2)  # (T, H, Dk, 1), (T, H, 1, Dk)
        decay = alpha[:, :, None, None]
        for t in range(n):
            state = state * decay[t]
            pred = torch.matmul(kcol[t].transpose(-1, -2), state)  # (H, 1, Dv): k^T S
            err = (v[t].unsqueeze(-2) - pred) * beta[t][:, None, None]
            state = torch.baddbmm(state, kcol[t], err)  # S += k (beta (v - k^T S))
            outs[t] = torch.matmul(qrow[t], state).squeeze(-2)
            ck = checkpoints.get(start + t + 1)
            if ck is not None:
                temporal_buf[ck] = state
                conv_buf[ck] = ext[t + 1 : t + 1 + km1].T
        temporal_buf[slot] = state
        conv_buf[slot] = ext[n : n + km1].T
        o = outs.reshape(n, hd) * F.silu(h @ p["z"])
        return o @ p["o"]


__all__ = [
    "CacheTensors",
    "HybridConfig",
    "HybridLM",
    "LayerKind",
    "LayerTimes",
    "SeqCache",
    "Wait",
]
