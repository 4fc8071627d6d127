"""HiCacheConnector under vLLM's real Scheduler, both roles in one process, no model
(tests/integrations/vllm/sched_harness.py): hits restore exactly the bytes saved for the same
tokens, and every failure path (preemption, abort, store errors) ends with nothing pinned and
every request finished. Every step checks that each position vLLM counts as computed holds
the bytes of its tokens (KVMismatch otherwise)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from vllm.v1.request import RequestStatus  # noqa: E402

from hicache.domain import CacheStateError  # noqa: E402
from tests.integrations.vllm.sched_harness import BLOCK, Harness, KVMismatch  # noqa: E402
from tests.integrations.vllm.sched_helpers import (  # noqa: E402
    Harnesses,
    connector_stat,
    hit_tokens,
    probe_host_tier,
    prompts,
    reference,
    warm_store_only,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module", autouse=True)
def _vllm_platform(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM resolves its platform and config defaults on the first VllmConfig (about a
    second, once per process): pay it here, not in the first test."""
    Harness(tmp_path_factory.mktemp("warm")).close()


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Harnesses]:
    harnesses = Harnesses(tmp_path)
    yield harnesses
    harnesses.close()


# ---- hits ---------------------------------------------------------------------------------


def test_a_prompt_saved_is_loaded_from_host_with_its_exact_bytes_after_a_prefix_cache_reset(
    make: Harnesses,
) -> None:
    h = make()
    prompt = prompts(1, 100)[0]
    first = h.add(prompt, max_tokens=4)
    h.settle()
    assert h.reset_prefix_cache()
    again = h.add(prompt, max_tokens=4)
    results = h.settle()
    # whole blocks, never the prompt's last token: 6 of the 100 tokens' blocks
    assert hit_tokens(results) == (len(prompt) - 1) // BLOCK * BLOCK == 96
    assert h.tokens[again] == h.tokens[first]
    assert h.control.gets == 0  # host only


def test_the_bytes_check_catches_a_computed_position_holding_wrong_bytes(
    make: Harnesses,
) -> None:
    """The harness's own invariant, shown to fail: a block of vLLM's prefix cache damaged
    behind vLLM's back is caught when the next request that hits it is computed."""
    h = make()
    prompt = prompts(1, 100)[0]
    h.add(prompt, max_tokens=1)
    h.settle()
    block = h.scheduler.kv_cache_manager.block_pool.blocks
    cached = [b.block_id for b in block if b.block_hash is not None and not b.is_null]
    assert cached
    h.rows[h.names[1]][cached] ^= 1  # flip a bit of every cached block of one layer
    h.add(prompt, max_tokens=1)
    with pytest.raises(KVMismatch, match="hold wrong bytes"):
        h.run()


def test_a_prompt_saved_under_one_cache_salt_hits_only_under_that_salt(
    make: Harnesses,
) -> None:
    h = make()
    prompt = prompts(1, 100, seed=14)[0]
    h.add(prompt, max_tokens=2, cache_salt="tenant-a")
    h.settle()
    hits = {}
    for salt in ("tenant-b", None, "tenant-a"):
        assert h.reset_prefix_cache()
        h.add(prompt, max_tokens=2, cache_salt=salt)
        hits[salt] = hit_tokens(h.settle())
    assert hits == {"tenant-b": 0, None: 0, "tenant-a": (len(prompt) - 1) // BLOCK * BLOCK}


def test_chunked_prefill_saves_every_block_and_a_later_prompt_hits_them(
    make: Harnesses,
) -> None:
    h = make(max_num_batched_tokens=64)
    prompt = prompts(1, 300)[0]
    first = h.add(prompt, max_tokens=2)
    results = h.settle()
    prefill_steps = sum(1 for r in results if first in r.scheduled.num_scheduled_tokens)
    assert prefill_steps >= 300 // 64  # really chunked
    page = 2 * BLOCK * 32  # two layers of one block
    assert connector_stat(results, "save_bytes") == (len(prompt) + 1) // BLOCK * page
    assert h.reset_prefix_cache()
    longer = [*prompt, *prompts(1, 150, seed=5)[0]]
    again = h.add(longer, max_tokens=2)
    results = h.settle()
    assert hit_tokens(results) == len(prompt) // BLOCK * BLOCK  # every block of the prompt
    assert h.tokens[again] == reference(make, [longer], 2)[0]


def test_a_storage_hit_loads_asynchronously_and_restores_the_same_output(
    make: Harnesses,
) -> None:
    h = make(store="directory", host_pages=16)
    prompt = prompts(1, 80)[0]
    warm_store_only(h, prompt)
    h.control.hold_reads()
    rid = h.add(prompt, max_tokens=3)
    results = [h.step()]
    assert h.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    results += [h.step() for _ in range(3)]  # nothing moves while the store holds the read
    assert h.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not h.tokens[rid]
    h.control.release_reads()
    results += h.settle()
    assert h.tokens[rid] == reference(make, [prompt], 3)[0]
    assert h.control.pages_read == (len(prompt) - 1) // BLOCK
    assert hit_tokens(results) == (len(prompt) - 1) // BLOCK * BLOCK
    assert probe_host_tier(h, 16) == (16 * BLOCK, 0)


# ---- failure paths leave nothing behind --------------------------------------------------


def test_the_leak_probe_sees_a_single_host_page_missing(make: Harnesses) -> None:
    """The probe every failure-path test ends with, shown to fail: asked for one page more
    than the host tier can hold, it reports the shortfall (as it would a page left pinned)."""
    h = make(host_pages=8)
    assert probe_host_tier(h, 8) == (8 * BLOCK, 0)
    assert probe_host_tier(h, 9, seed=5) == (8 * BLOCK, 0)


def test_preemption_while_an_asynchronous_load_is_pending_leaks_nothing(
    make: Harnesses,
) -> None:
    h = make(store="directory", host_pages=8, num_blocks=16)
    stored = prompts(1, 80, seed=1)[0]
    warm_store_only(h, stored)
    h.control.hold_reads()
    long = prompts(1, 64, seed=2)[0]
    a = h.add(long, max_tokens=120)  # decodes into every free block: preempted
    b = h.add(stored, max_tokens=4)  # a storage hit held by the store
    preempted = False
    for _ in range(150):
        h.step()
        req = h.scheduler.requests.get(a)
        preempted |= req is not None and req.num_preemptions > 0
        if preempted:
            break
    assert preempted
    assert h.status(b) == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.control.release_reads()
    h.settle()
    assert h.finish_reasons[a] == h.finish_reasons[b] == "length"
    assert h.tokens[a] == reference(make, [long], 120)[0]
    assert h.tokens[b] == reference(make, [stored], 4)[0]
    assert not h.scheduler.requests
    assert probe_host_tier(h, 8) == (8 * BLOCK, 0)


def test_a_request_aborted_during_its_asynchronous_load_frees_everything(
    make: Harnesses,
) -> None:
    h = make(store="directory", host_pages=8)
    prompt = prompts(1, 80, seed=3)[0]
    warm_store_only(h, prompt)
    h.control.hold_reads()
    rid = h.add(prompt, max_tokens=4)
    other = h.add(prompts(1, 40, seed=4)[0], max_tokens=8)  # computes meanwhile
    h.step()
    assert h.status(rid) == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.abort(rid)
    h.step()
    h.control.release_reads()
    h.settle()
    assert not h.scheduler.requests  # vLLM freed the aborted request's blocks
    assert h.finish_reasons[other] == "length"
    assert h.tokens[rid] == []
    # the pages the aborted load read are usable: the same prompt now hits
    again = h.add(prompt, max_tokens=4)
    results = h.settle()
    assert hit_tokens(results) == (len(prompt) - 1) // BLOCK * BLOCK
    assert h.tokens[again] == reference(make, [prompt], 4)[0]
    assert probe_host_tier(h, 8) == (8 * BLOCK, 0)


def test_a_store_that_fails_reads_makes_vllm_recompute_and_finish_the_request(
    make: Harnesses,
) -> None:
    h = make(store="directory", host_pages=8)
    prompt = prompts(1, 80, seed=6)[0]
    warm_store_only(h, prompt)
    h.control.fail_reads = True
    rid = h.add(prompt, max_tokens=4)
    results = h.settle()
    kv = [r.kv for r in results if r.kv is not None]
    assert any(k.invalid_block_ids for k in kv)  # vLLM was told which blocks failed
    assert h.tokens[rid] == reference(make, [prompt], 4)[0]  # recomputed, right bytes
    assert h.control.gets >= 1
    # the recomputed blocks were saved again: a later ask hits them (from host)
    h.control.fail_reads = False
    assert h.reset_prefix_cache()
    gets = h.control.gets
    again = h.add(prompt, max_tokens=4)
    results = h.settle()
    assert hit_tokens(results) == (len(prompt) - 1) // BLOCK * BLOCK
    assert h.control.gets == gets
    assert h.tokens[again] == h.tokens[rid]
    assert probe_host_tier(h, 8) == (8 * BLOCK, 0)


def test_a_read_failing_midway_loads_the_pages_before_it_and_vllm_recomputes_the_rest(
    make: Harnesses,
) -> None:
    h = make(store="directory", host_pages=16)
    prompt = prompts(1, 100, seed=10)[0]
    warm_store_only(h, prompt)
    h.control.fail_reads_after = 2  # pages 3.. of the read fail
    rid = h.add(prompt, max_tokens=4)
    results = h.settle()
    invalid = set().union(*(r.kv.invalid_block_ids for r in results if r.kv is not None))
    assert len(invalid) == (len(prompt) - 1) // BLOCK - 2  # every page after the second
    assert h.tokens[rid] == reference(make, [prompt], 4)[0]
    assert probe_host_tier(h, 16) == (16 * BLOCK, 0)


def test_the_next_turn_of_a_chat_hits_the_blocks_its_decode_filled(make: Harnesses) -> None:
    h = make()
    prompt = prompts(1, 60, seed=12)[0]
    first = h.add(prompt, max_tokens=40)
    h.settle()
    assert h.reset_prefix_cache()
    turn = [*prompt, *h.tokens[first], *prompts(1, 20, seed=13)[0]]
    again = h.add(turn, max_tokens=2)
    results = h.settle()
    # vLLM computed 99 positions (the last sampled token is never fed back): 6 full blocks,
    # 2 of them written by decode steps
    assert hit_tokens(results) == (len(prompt) + 40 - 1) // BLOCK * BLOCK == 96
    assert h.tokens[again] == reference(make, [turn], 2)[0]


def test_a_store_whose_exists_fails_is_a_miss_not_an_error(make: Harnesses) -> None:
    h = make(store="directory", host_pages=8)
    prompt = prompts(1, 80, seed=7)[0]
    warm_store_only(h, prompt)
    h.control.fail_exists = True
    rid = h.add(prompt, max_tokens=4)
    results = h.settle()
    assert hit_tokens(results) == 0
    assert h.tokens[rid] == reference(make, [prompt], 4)[0]


# ---- reset ---------------------------------------------------------------------------------


def test_reset_prefix_cache_succeeds_with_the_connector_before_and_after_requests(
    make: Harnesses,
) -> None:
    h = make(store="directory")
    assert h.reset_prefix_cache()
    assert h.reset_prefix_cache(connector=True)
    prompt = prompts(1, 70, seed=8)[0]
    h.add(prompt, max_tokens=3)
    h.step()
    assert not h.reset_prefix_cache()  # vLLM's own rule: a running request holds blocks
    h.settle()
    assert h.reset_prefix_cache()
    assert h.reset_prefix_cache(connector=True)


def test_resetting_the_connector_cache_forgets_host_pages_but_not_the_store(
    make: Harnesses,
) -> None:
    host_only = make()
    prompt = prompts(1, 70, seed=9)[0]
    host_only.add(prompt, max_tokens=1)
    host_only.settle()
    assert host_only.reset_prefix_cache(connector=True)
    host_only.add(prompt, max_tokens=1)
    assert hit_tokens(host_only.settle()) == 0

    stored = make(store="directory")
    stored.add(prompt, max_tokens=1)
    stored.settle()
    assert stored.reset_prefix_cache(connector=True)
    stored.add(prompt, max_tokens=1)
    assert hit_tokens(stored.settle()) == (len(prompt) - 1) // BLOCK * BLOCK
    assert stored.control.pages_read == (len(prompt) - 1) // BLOCK


# ---- many requests -------------------------------------------------------------------------


def test_32_concurrent_requests_sharing_prefixes_all_finish_and_hit_their_pages(
    make: Harnesses,
) -> None:
    groups = [prompts(8, 72, shared=48, seed=20 + g) for g in range(4)]
    batch = [p for g in groups for p in g]
    h = make(host_pages=64, num_blocks=256, max_num_batched_tokens=512)
    ids = [h.add(p, max_tokens=3) for p in batch]
    h.settle()
    assert all(h.finish_reasons[i] == "length" for i in ids)
    first = [h.tokens[i] for i in ids]
    assert h.reset_prefix_cache()
    again = [h.add(p, max_tokens=3) for p in batch]
    results = h.settle()
    assert [h.tokens[i] for i in again] == first
    # every prompt's 4 full blocks were on host: each block of each request is restored
    # exactly once, by vLLM's own cache (a prefix another request of the batch brought back)
    # or by the connector, and the connector restored every distinct block at least once
    full = (72 - 1) // BLOCK * BLOCK
    local = sum(r.local_hits for r in results)
    assert hit_tokens(results) + local == 32 * full
    distinct = 4 * (48 // BLOCK) + 32 * ((72 - 1) // BLOCK - 48 // BLOCK)
    assert hit_tokens(results) >= distinct * BLOCK
    assert probe_host_tier(h, 64) == (64 * BLOCK, 0)


def test_the_connectors_hit_counters_equal_the_tokens_vllm_counted_as_loaded(
    make: Harnesses,
) -> None:
    h = make()
    batch = prompts(8, 72, shared=48, seed=30)
    for p in batch:
        h.add(p, max_tokens=2)
    h.settle()
    assert h.reset_prefix_cache()
    for p in batch:
        h.add(p, max_tokens=2)
    results = h.settle()
    loaded = hit_tokens(results)
    assert loaded > 0
    assert connector_stat(results, "hit_tokens_host") == loaded


def test_once_every_request_ended_neither_role_holds_a_request_or_a_transfer(
    make: Harnesses,
) -> None:
    """What the soak's leak check reads: a request in flight is tracked by the scheduler role,
    none is once all ended and the worker's copies and store calls are done."""
    h = make(store="directory")
    side = h.scheduler.connector.scheduler_role
    transfers = h.worker.worker_role.transfers
    h.add(prompts(1, 100)[0], max_tokens=4)
    h.step()
    assert side.tracked_requests() > 0
    h.settle()
    transfers.wait_idle()
    assert side.tracked_requests() == 0
    assert transfers.pending_transfers() == 0
    with pytest.raises(CacheStateError, match="scheduler-side hook"):
        _ = h.worker.scheduler_role
    with pytest.raises(CacheStateError, match="worker-side hook"):
        _ = h.scheduler.connector.worker_role
