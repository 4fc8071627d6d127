"""Expected plan documents of the bundled dense and single-hybrid fixtures, worked out by hand.

EXPECTED[(name, tp)] holds each pool's role, layers, unit, bytes per unit per layer, capacity and
binding; expected_document(name, tp) is the part of ``HostGroupPlan.as_json`` (and ``hicache plan
--json``) they fix, actual_document(doc) the same parts of an actual document. The derivation of
every figure is in the comments below.

Every fixture is planned at tp 1 and tp 8 with the defaults of `hicache plan` (page size 64,
65536 device tokens, 256 device state slots, host ratio 2.0): token pools hold
65536 x 2 = 131072 tokens, state pools 256 x 2 = 512 slots. All six fixtures allow tp 8:
KV heads split or are replicated (llama 8 -> 1, gpt-oss 8 -> 1, nemotron-h 8 -> 1, qwen3-next
2 -> replicated 1 per rank), MLA latents are replicated, and the recurrent heads divide by 8
(nemotron-h 128 Mamba heads, qwen3-next 16 key / 32 value heads). Sizes that do not divide are
errors, checked at the end (e.g. qwen3-next at tp 32, any MHA fixture at tp 3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

TOKENS = 65536 * 2  # host tokens of every token pool
SLOTS = 256 * 2  # host slots of every state pool


def bind(transfer_layers: Iterable[int]) -> dict[str, int]:
    """The JSON binding of a pool whose layers are ``transfer_layers`` in order."""
    return {str(t): i for i, t in enumerate(transfer_layers)}


def token_pool(role: str, layers: Iterable[int], per_layer: int) -> dict[str, Any]:
    t = list(layers)
    return {
        "role": role,
        "layers": len(t),
        "unit": "token",
        "bytes_per_unit_per_layer": per_layer,
        "capacity": TOKENS,
        "binding": bind(t),
    }


def slot_pool(layers: Iterable[int], per_layer: int) -> dict[str, Any]:
    t = list(layers)
    return {
        "role": "independent",
        "layers": len(t),
        "unit": "slot",
        "bytes_per_unit_per_layer": per_layer,
        "capacity": SLOTS,
        "binding": bind(t),
    }


# ---- llama-3.1-8b-instruct: 32 layers, 8 KV heads, head_dim 4096 / 32 = 128, bf16 -------------
LLAMA_TP1 = 2 * 8 * 128 * 2  # K and V x 8 heads x 128 x 2 bytes = 4096
LLAMA_TP8 = 2 * 1 * 128 * 2  # 8 heads / 8 ranks = 1 head: 512

# ---- deepseek-v3: 61 layers (the MTP layer gets none), MLA latent 512 + rope 64, bf16 --------
MLA_ROW = (512 + 64) * 2  # 1152, the same on every TP rank
# ---- deepseek-v3.2-exp: the same MLA, plus an indexer: 1 K head x (128 fp8 + 1 f32 scale) ----
INDEXER_ROW = 1 * (128 * 1 + (128 // 128) * 4)  # 132

# ---- gpt-oss-20b: 24 layers alternating sliding (even) / full (odd), 8 KV heads x 64, bf16 ----
GPT_OSS_TP1 = 2 * 8 * 64 * 2  # 2048
GPT_OSS_TP8 = 2 * 1 * 64 * 2  # 256

# ---- nemotron-h-8b: pattern M-M-M-M*-M-M-M-M-M*-...: 24 Mamba2, 4 attention, 24 MLP-only ------
# Transfer layers number the 28 cached layers; attention sits at transfer 4, 10, 16, 22.
NEMO_ATTN = [4, 10, 16, 22]
NEMO_MAMBA = [t for t in range(28) if t not in NEMO_ATTN]
NEMO_KV_TP1 = 2 * 8 * 128 * 2  # attention_head_dim 128: 4096
NEMO_KV_TP8 = 2 * 1 * 128 * 2  # 512
# Mamba2: conv (heads x head_dim + 2 x groups x state, kernel - 1) bf16 + temporal f32
NEMO_STATE_TP1 = (128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4  # 61440 + 4194304
NEMO_STATE_TP8 = (16 * 64 + 2 * 1 * 128) * 3 * 2 + 16 * 64 * 128 * 4  # 7680 + 524288

# ---- qwen3-next-80b-a3b: 48 layers, full attention every 4th (3, 7, ..., 47), 36 linear -------
QN_FULL = list(range(3, 48, 4))
QN_LINEAR = [i for i in range(48) if i % 4 != 3]
QN_KV_TP1 = 2 * 2 * 256 * 2  # 2 KV heads x 256: 2048
QN_KV_TP8 = 2 * 1 * 256 * 2  # 2 heads over 8 ranks: replicated, 1 per rank: 1024
# Gated DeltaNet: conv (2 x key_heads x 128 + value_heads x 128, 3) bf16 + (v_heads, 128, 128) f32
QN_STATE_TP1 = (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4  # 49152 + 2097152
QN_STATE_TP8 = (2 * 2 * 128 + 4 * 128) * 3 * 2 + 4 * 128 * 128 * 4  # 6144 + 262144

EXPECTED: dict[tuple[str, int], dict[str, Any]] = {
    ("llama-3.1-8b-instruct", 1): {
        "model_type": "llama",
        "transfer_layers": 32,
        "pools": {"kv": token_pool("anchor", range(32), LLAMA_TP1)},
    },
    ("llama-3.1-8b-instruct", 8): {
        "model_type": "llama",
        "transfer_layers": 32,
        "pools": {"kv": token_pool("anchor", range(32), LLAMA_TP8)},
    },
    **{
        ("deepseek-v3", tp): {
            "model_type": "deepseek_v3",
            "transfer_layers": 61,
            "pools": {"kv": token_pool("anchor", range(61), MLA_ROW)},
        }
        for tp in (1, 8)
    },
    **{
        ("deepseek-v3.2-exp", tp): {
            "model_type": "deepseek_v32",
            "transfer_layers": 61,
            "pools": {
                "kv": token_pool("anchor", range(61), MLA_ROW),
                "indexer": token_pool("sidecar", range(61), INDEXER_ROW),
            },
        }
        for tp in (1, 8)
    },
    **{
        ("gpt-oss-20b", tp): {
            "model_type": "gpt_oss",
            "transfer_layers": 24,
            "pools": {
                "kv": token_pool("anchor", range(1, 24, 2), per_layer),
                "swa": token_pool("independent", range(0, 24, 2), per_layer),
            },
        }
        for tp, per_layer in ((1, GPT_OSS_TP1), (8, GPT_OSS_TP8))
    },
    **{
        ("nemotron-h-8b-base-8k", tp): {
            "model_type": "nemotron_h",
            "transfer_layers": 28,
            "pools": {
                "kv": token_pool("anchor", NEMO_ATTN, kv),
                "mamba": slot_pool(NEMO_MAMBA, state),
            },
        }
        for tp, kv, state in ((1, NEMO_KV_TP1, NEMO_STATE_TP1), (8, NEMO_KV_TP8, NEMO_STATE_TP8))
    },
    **{
        ("qwen3-next-80b-a3b-instruct", tp): {
            "model_type": "qwen3_next",
            "transfer_layers": 48,
            "pools": {
                "kv": token_pool("anchor", QN_FULL, kv),
                "mamba": slot_pool(QN_LINEAR, state),
            },
        }
        for tp, kv, state in ((1, QN_KV_TP1, QN_STATE_TP1), (8, QN_KV_TP8, QN_STATE_TP8))
    },
}

POOL_KEYS = ("role", "layers", "unit", "bytes_per_unit_per_layer", "capacity", "binding")


def expected_document(name: str, tp: int) -> dict[str, Any]:
    """The expected parts of the plan document (``HostGroupPlan.as_json`` / ``plan --json``)."""
    exp = EXPECTED[(name, tp)]
    pools = exp["pools"]
    return {
        "model_type": exp["model_type"],
        "tp_size": tp,
        "page_size": 64,
        "layout": "page_first_direct",
        "transfer_layers": exp["transfer_layers"],
        "host_memory": {"kind": "anonymous", "pinned": "auto"},
        "host_bytes_total": sum(
            p["bytes_per_unit_per_layer"] * p["layers"] * p["capacity"] for p in pools.values()
        ),
        "pools": pools,
    }


def actual_document(doc: dict[str, Any]) -> dict[str, Any]:
    """The same parts of an actual plan document, pools keyed by name."""
    out = {k: doc[k] for k in ("model_type", "tp_size", "page_size", "layout", "transfer_layers")}
    out["host_memory"] = doc["host_memory"]
    out["host_bytes_total"] = doc["host_bytes_total"]
    out["pools"] = {p["name"]: {k: p[k] for k in POOL_KEYS} for p in doc["pools"]}
    return out
