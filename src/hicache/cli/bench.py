"""`hicache bench`: measurements that report ratios against a baseline measured in the same run.

Each subcommand's module here parses its flags and prints; the measuring code is in
hicache.bench (named after each line).

- bench copy: host <-> device copy backends against a contiguous copy (hicache.bench.copy).
- bench overlap: layer-wise loads overlapped with compute (hicache.bench.overlap).
- bench engine: the engine's own costs, copies excluded (hicache.bench.engine).
- bench cache: page-key hashing and the prefix index's cost per page (hicache.bench.cache).
- bench storage: a store's put/get/exists against plain file I/O (hicache.bench.storage).
- bench sglang: SGLang's HiCacheFile against hicache's SGLang backend
  (hicache.integrations.sglang.bench).
- bench scale: copy time per byte and planner time per layer as sizes grow (hicache.bench.scale).
- bench soak: random cache operations with injected faults; leak and byte checks
  (hicache.bench.soak).
- bench vllm: TTFT of a real vLLM with HiCacheConnector (hicache.integrations.vllm.bench; needs vLLM).
- bench vllm-worker: the connector's worker copies and compute slowed by saves, CPU and CUDA
  (hicache.bench.vllm_worker; no vLLM).
"""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    from hicache.cli import (
        bench_cache,
        bench_copy,
        bench_engine,
        bench_overlap,
        bench_scale,
        bench_sglang,
        bench_soak,
        bench_storage,
        bench_vllm,
        bench_worker,
    )

    p = sub.add_parser(
        "bench",
        help="measure copies, overlap and storage (ratios to a same-run baseline)",
        description=(
            "Measurements that report ratios against a baseline timed in the same run: copy "
            "backends, layer-wise overlap, the engine's own costs, the cache index, stores, "
            "scaling and a fault-injecting soak. Each prints a table, or one JSON document with "
            "--json."
        ),
    )
    inner = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    bench_copy.register(inner)
    bench_overlap.register(inner)
    bench_engine.register(inner)
    bench_cache.register(inner)
    bench_storage.register(inner)
    bench_sglang.register(inner)
    bench_scale.register(inner)
    bench_soak.register(inner)
    bench_vllm.register(inner)
    bench_worker.register(inner)
