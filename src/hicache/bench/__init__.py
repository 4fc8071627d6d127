"""The measuring code of `hicache bench`: one module per bench, each a front-free library.

Every `hicache bench <name>` command in hicache.cli is a thin front on one module here (it
parses arguments and formats the output); the measuring, the baselines and the JSON document
are built here.

- copy: host <-> device copy backends against a contiguous copy (torch).
- overlap: layer-wise loads overlapped with synthetic compute.
- engine: the transfer engine's own costs, copies excluded.
- cache: page-key hashing and the prefix index's cost per page.
- storage: a store's put/get/exists against plain file I/O of the same bytes (torch).
- scale: copy time per byte, planner time per layer, index cost per page as sizes grow (torch).
- soak: random cache operations over every stack with injected faults; leak and byte checks.
- vllm_worker: the vLLM connector's worker copies and compute slowed by saves, without vLLM.

The benches that drive a serving engine live with its integration, the only code that imports
that engine: hicache.integrations.vllm.bench (`hicache bench vllm`) and
hicache.integrations.sglang.bench (`hicache bench sglang`).

The package sits above hicache.integrations and below hicache.cli (pyproject.toml's layers): it
measures adapters, the bootstrap and the integrations' vLLM-free parts. Importing this package
loads no submodule; the modules that
import torch (copy, storage, scale, vllm_worker) are imported by the cli only when their
command runs, so the command line stays torch-free.
"""
