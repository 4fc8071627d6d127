"""What a read across tensor parallel sizes costs beside a read at the same size (no vLLM).

``python -m hicache.integrations.vllm.bench_tp_reads [--pages N] [--repeats R]`` stores
``pages`` pages of a model with 8 KV heads (8 layers, head size 128, block 32, bf16: vLLM's CPU
cache order) in a DirectoryStore at tp 1 and at tp 2, then times WorkerTransfers' asynchronous
load of them (store -> host -> the worker's caches) by one reader rank: tp 1 from tp 1 objects
(in place: the baseline), tp 1 from tp 2 objects (two objects per page, each half of the heads,
staged and sliced) and rank 0 of tp 2 from tp 1 objects (one object staged, half of it
copied: half the bytes of the baseline reach the caches). The cases run in turn, ``repeats``
times. Prints one JSON line: each case's median seconds and its ratio to the baseline, all
measured in this run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hicache.adapters.storage import DirectoryStore
from hicache.adapters.storage.directory_settings import DirectorySettings
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.plan import LoadOp, SaveOp, StepPlan, store_key
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_plan import TpHeads, heads_of
from hicache.integrations.vllm.tp_reads import TpReader, head_geometry
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows

HEADS, LAYERS, HEAD, BLOCK = 8, 8, 128, 32


def _caches(blocks: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    lo, hi = heads_of(rank, tp, HEADS)
    g = torch.Generator().manual_seed(7)
    full = [
        torch.randn(blocks, HEADS, BLOCK, 2 * HEAD, generator=g).to(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    return {f"layer.{i}": t[:, lo:hi].contiguous() for i, t in enumerate(full)}


def _worker(
    caches: dict[str, torch.Tensor], store: BoundedStorage, blocks: int, tp: int, rank: int
) -> WorkerTransfers:
    heads = TpHeads(HEADS)
    layers = [(n, block_rows(n, t, blocks)) for n, t in caches.items()]
    geometry = [head_geometry(n, t, blocks, heads.per_rank(tp)) for n, t in caches.items()]
    return WorkerTransfers(
        layers,
        host_bytes=blocks * sum(r.shape[1] for _, r in layers),
        store=store,
        store_key=lambda page: store_key("bench", rank, page, tp),
        stats=ConnectorStats(),
        rank=rank,
        tp_reads=TpReader(heads, tp, rank, geometry),
    )


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    pages, blocks = args.pages, args.pages
    with tempfile.TemporaryDirectory(prefix="hicache-bench-tp-") as root:
        store = BoundedStorage(DirectoryStore(DirectorySettings(root=Path(root))))
        for tp in (1, 2):
            for r in range(tp):
                w = _worker(_caches(blocks, tp, r), store, blocks, tp, r)
                w.start_step(
                    StepPlan(saves=[SaveOp("w", _key(p), p, p, True) for p in range(pages)])
                )
                w.finish_step()
                w.wait_idle()
                w.close()
        cases = {"same_size_tp1_from_tp1": (1, 1), "tp1_from_tp2": (2, 1), "tp2_from_tp1": (1, 2)}
        workers = {}
        for name, (_, readers) in cases.items():
            caches = {n: torch.zeros_like(t) for n, t in _caches(blocks, readers, 0).items()}
            workers[name] = _worker(caches, store, blocks, readers, 0)
        runs: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.repeats):  # the cases in turn: the machine's load hits each alike
            for name, (writers, _) in cases.items():
                w = workers[name]
                op = LoadOp(
                    "r",
                    tuple(_key(p) for p in range(pages)),
                    tuple(range(pages)),
                    tuple(range(pages)),
                    (True,) * pages,
                    writers=(writers,) * pages,
                )
                t0 = time.perf_counter()
                w.start_step(StepPlan(async_loads=[op]))
                w.finish_step()
                w.wait_idle()
                runs[name].append(time.perf_counter() - t0)
                if w.drain_errors():
                    raise SystemExit(f"{name}: a load failed")
                w.drain_events()
        for w in workers.values():
            w.close()
        times = {name: statistics.median(r) for name, r in runs.items()}
        store.close()
    base = times["same_size_tp1_from_tp1"]
    page_bytes = LAYERS * HEADS * BLOCK * 2 * HEAD * 2
    print(
        json.dumps(
            {
                "pages": pages,
                "page_bytes_tp1": page_bytes,
                "seconds": {k: round(v, 4) for k, v in times.items()},
                "ratio_to_same_size": {k: round(v / base, 2) for k, v in times.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
