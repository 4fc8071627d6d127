"""The vLLM soak's setup (hicache.integrations.vllm.soak): its store plug-in, the bytes its
"model" computes, and vLLM's configuration of a weightless tiny Llama with HiCacheConnector.

- SoakStore: hicache's DirectoryStore (checksums on) as a "dynamic" plug-in under FaultyStore
  (TRANSIENT / FATAL / FULL answers, bytes flipped on disk after a put, stalls within the
  deadline), with the faults of the soak its ``soak_id`` names (register / unregister); under
  the "damage" sabotage a page read OK gets a byte flipped afterwards, past the checksum.
- KVModel.expected(rid, tokens, upto): ``(upto, LAYERS, TOKEN_BYTES)`` uint8, position p's KV
  from a digest chain over the tokens up to p.
- vllm_config(root, soak_id): the VllmConfig (CPU, prefix caching, chunked prefill, NUM_BLOCKS
  blocks, a host tier of HOST_PAGES pages, the store above with DEADLINE_S per call).
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.faults import Faults, FaultyStore, StoreFaultRates, directory_corruptor

BLOCK = 16  # tokens per block
LAYERS = 2
HEAD = 8  # head size, one KV head, bfloat16
TOKEN_BYTES = 2 * HEAD * 2  # K and V of one token in one layer
NUM_BLOCKS = 48  # vLLM's blocks: small, so vLLM preempts and evicts
HOST_PAGES = 40  # the connector's host tier
POISON = 0xA5
VOCAB = 1000
SABOTAGE = frozenset({"damage", "leak_pins"})
# stalls of 10 ms, well within DEADLINE_S
STORE_FAULTS = StoreFaultRates(
    transient=0.03, full=0.02, fatal=0.01, corrupt=0.05, stall=0.02, stall_s=0.01, fail_first=True
)
DEADLINE_S = 0.5

_RUNS: dict[str, tuple[Faults, frozenset[str]]] = {}  # soak id -> what its stores inject
_RUNS_LOCK = threading.Lock()


def register(faults: Faults, sabotage: frozenset[str]) -> str:
    """A new soak id under which SoakStore finds ``faults`` and ``sabotage``."""
    soak_id = uuid.uuid4().hex
    with _RUNS_LOCK:
        _RUNS[soak_id] = (faults, sabotage)
    return soak_id


def unregister(soak_id: str) -> None:
    with _RUNS_LOCK:
        _RUNS.pop(soak_id, None)


class SoakStore(FaultyStore):
    """The soak's store plug-in: a DirectoryStore at ``root`` under FaultyStore, with the faults
    of the soak its ``soak_id`` names (the scheduler and worker roles each open one)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        cfg = dict(config)
        with _RUNS_LOCK:
            faults, sabotage = _RUNS[str(cfg.get("soak_id"))]
        root = str(cfg["root"])
        rates = STORE_FAULTS
        if "damage" in sabotage:
            rates = attrs.evolve(rates, damage_read=1.0)
        super().__init__(
            DirectoryStore(DirectorySettings(root=root)),
            faults,
            rates,
            corrupt=directory_corruptor(root),
        )


class KVModel:
    """Deterministic KV bytes: position p of a sequence, all layers, from a digest chain over
    its tokens up to p; ``(n, LAYERS, TOKEN_BYTES)`` uint8, memoised per request."""

    def __init__(self) -> None:
        self._memo: dict[str, tuple[list[int], list[bytes]]] = {}

    def expected(self, rid: str, tokens: Sequence[int], upto: int) -> np.ndarray:
        known, digests = self._memo.get(rid, ([], []))
        same = 0
        while same < min(len(known), upto) and known[same] == tokens[same]:
            same += 1
        digests = digests[:same]
        prev = digests[-1] if digests else b""
        for p in range(same, upto):
            prev = hashlib.blake2b(prev + int(tokens[p]).to_bytes(4, "little")).digest()
            digests.append(prev)
        self._memo[rid] = (list(tokens[:upto]), digests)
        raw = np.frombuffer(b"".join(digests[:upto]), dtype=np.uint8)
        return raw.reshape(upto, LAYERS, TOKEN_BYTES)

    def forget(self, rid: str) -> None:
        self._memo.pop(rid, None)


def vllm_config(root: Path, soak_id: str) -> VllmConfig:
    folder = root / "tiny-llama"
    folder.mkdir(parents=True, exist_ok=True)
    model = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": HEAD,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(model))
    page = LAYERS * BLOCK * TOKEN_BYTES
    extra = {
        "host_gib": (HOST_PAGES * page + 0.5) / (1 << 30),
        "storage_backend": "dynamic",
        "storage_extra_config": {
            "module_path": __name__,
            "class_name": SoakStore.__name__,
            "soak_id": soak_id,
            "root": str(root / "store"),
        },
        "deadline_s": DEADLINE_S,
        "grace_s": DEADLINE_S,
        # every hit loaded: the compute here is fake (nearly free), so load_policy "measured"
        # would decline the hits and leave the load and read paths under faults unexercised
        "load_policy": "always",
    }
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    return config
