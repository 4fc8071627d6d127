"""Measures what changes vLLM's own greedy bf16 tokens (docs/vllm.md, "Greedy tokens").

``python -m tests.integrations.vllm.greedy_drift MODEL_DIR WORK_DIR`` (MODEL_DIR: runner.make_model's
tiny Llama) runs the runner once, in-process, with a fresh LLM per phase: no connector,
vLLM's ExampleConnector and HiCacheConnector (cold: empty host tier and store), each with
PROMPT0 alone, with PROMPT1 (which shares its first 192 tokens) and in a batch of 8; 128 greedy
tokens. Prints one line per phase: whether PROMPT0's tokens equal those of "none, alone", the
first position that differs, and whether every prompt's tokens equal the same batch without a
connector.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from tests.integrations.vllm.scenario import PROMPT0, PROMPT1

CONNECTORS = ("none", "ExampleConnector", "HiCacheConnector")
BATCHES = (("alone", [0]), ("with PROMPT1", [0, 1]), ("batch of 8", list(range(8))))


def spec(model: Path, work: Path) -> dict[str, object]:
    rng = random.Random(7)
    others = [[rng.randrange(1, 1000) for _ in range(rng.randrange(50, 400))] for _ in range(6)]
    phases = []
    for c in CONNECTORS:
        for label, which in BATCHES:
            where = str(work / f"{c}-{label.replace(' ', '_')}")
            config = {
                "none": None,
                "ExampleConnector": {"shared_storage_path": where},
                "HiCacheConnector": {
                    "host_gib": 0.25,
                    "storage_backend": "directory",
                    "storage_path": where,
                },
            }[c]
            name = "HiCacheConnector" if c == "none" else c
            phases.append({"name": name, "connector": config, "steps": [["gen", which]]})
    return {
        "model": str(model),
        "mode": "inproc",
        "max_tokens": 128,
        "prompts": [PROMPT0, PROMPT1, *others],
        "phases": phases,
    }


def main(model: Path, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    path = work / "spec.json"
    path.write_text(json.dumps(spec(model, work)))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    out = subprocess.run(
        [sys.executable, "-m", "tests.integrations.vllm.runner", str(path)],
        env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    line = [ln for ln in out.splitlines() if ln.startswith("HICACHE-RESULT ")][-1]
    phases = json.loads(line.removeprefix("HICACHE-RESULT "))["phases"]
    tokens = [[o["tokens"] for o in ph[0]] for ph in phases]
    ref = tokens[0][0]
    for i, (c, (label, _)) in enumerate((c, b) for c in CONNECTORS for b in BATCHES):
        p0 = tokens[i][0]
        first = next((j for j, (a, b) in enumerate(zip(p0, ref, strict=True)) if a != b), None)
        same_batch = tokens[i] == tokens[i % len(BATCHES)]
        print(
            f"{c:17s} {label:13s} PROMPT0 as alone without connector: {p0 == ref} "
            f"(first difference at {first}); every prompt as without connector: {same_batch}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
