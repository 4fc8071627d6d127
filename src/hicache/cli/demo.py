"""`hicache demo`: a small hybrid model served through hicache: recompute, host hit, storage hit.

Runs the demo workload (hicache.demo.workload: a system prompt, a multi-turn chat and a branch)
on the demo model (full attention with an indexer, sliding window, Gated DeltaNet), checks every
cached run against a recompute of the same prompt, and prints a summary table on stdout (progress
on stderr) or, with ``--json``, one JSON document. What native libraries write to stderr
(Mooncake's glog lines) goes to a log file (``--log-file``), or among the progress with
``--verbose``. The demo package imports torch, so it is
imported here only inside the command. See docs/demo.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hicache.cli._logs import NativeStderrToFile, QuietLogs
from hicache.domain import ConfigError

MAX_ABS_DIFF = 1e-5  # fp32 logits of a cached run against recompute (issue 11's target)
KEYS = (
    "device",
    "model",
    "turns",
    "ttft_ms",
    "hit_tokens",
    "max_abs_diff",
    "tokens_identical",
    "exposed_fraction",
)


FOOTER = (
    "tokens: prompt length; hit: prompt tokens restored from the cache instead of computed.",
    "recompute / host hit / storage hit ms: time to first token computing the whole prompt /",
    "  restoring the hit from host memory / from the store (its prefetch included).",
    "max |diff|: largest logit difference from recompute (0 = identical); tokens: same greedy",
    "  tokens as recompute. exposed fraction: share of the copy time the model sat waiting for",
    "  it (0 = compute hid every copy, 1 = none). See docs/demo.md.",
)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="serve a small hybrid model through hicache: recompute vs host hit vs storage hit",
        description=(
            "A system prompt, a multi-turn chat and a branch on a small hybrid model (full "
            "attention + indexer, sliding window, Gated DeltaNet). Every request runs "
            "recomputed, restored from host memory layer by layer, and (with a store) restored "
            "from storage after the host copy was evicted; the outputs are compared."
        ),
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or rocm[:N]")
    p.add_argument("--turns", type=int, default=3, help="chat turns after the system prompt")
    p.add_argument("--prefix-tokens", type=int, default=2048, help="system prompt tokens")
    p.add_argument(
        "--storage",
        default="directory",
        help=(
            "storage tier: one of directory (a temporary folder removed afterwards), "
            "mooncake (a local master and storage node, started and stopped), none"
        ),
    )
    p.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG timeline: per request, host and storage hit, each layer's load, wait "
        "and compute (needs matplotlib)",
    )
    p.add_argument(
        "--metrics",
        metavar="PATH",
        help=(
            "write a Prometheus scrape of the demo's cache after the run to PATH (text format; "
            "needs hicache[metrics]); see docs/metrics.md"
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument(
        "--log-file",
        metavar="PATH",
        default=None,
        help="where the log lines of native libraries (Mooncake's client) go, kept apart from "
        "the progress (default: hicache-demo-PID.log in the temporary folder, removed if empty)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show the native libraries' log lines among the progress instead",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError(
            f"--plot {args.plot}: needs matplotlib, which is not installed "
            f"(pip install 'hicache[plot]')"
        )
    if args.metrics is not None and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError(
            f"--metrics {args.metrics}: needs prometheus-client, which is not installed "
            f"(pip install 'hicache[metrics]')"
        )
    if args.metrics is not None and not os.path.isdir(os.path.dirname(args.metrics) or "."):
        raise ConfigError(f"--metrics {args.metrics}: its folder does not exist")
    import anyio

    from hicache.demo.workload import DemoSettings, run_demo
    from hicache.metrics import HiCacheMetrics

    settings = DemoSettings(
        device=args.device,
        turns=args.turns,
        prefix_tokens=args.prefix_tokens,
        storage=args.storage,
    )
    settings.check()  # bad flags fail before the model is built

    def progress(message: str) -> None:
        sys.stderr.write(f"hicache demo: {message}\n")
        sys.stderr.flush()

    log_path = Path(args.log_file) if args.log_file else _default_log()
    native = None if args.verbose else NativeStderrToFile(log_path)
    metrics = HiCacheMetrics() if args.metrics is not None else None
    with native if native is not None else contextlib.nullcontext(), QuietLogs():
        result: dict[str, Any] = anyio.run(
            lambda: run_demo(settings, progress=progress, metrics=metrics)
        )
    if native is not None and native.lines_written():
        progress(f"log lines of native libraries (Mooncake) went to {log_path}")
    elif native is not None and args.log_file is None:
        log_path.unlink(missing_ok=True)
    timelines = result.pop("_timelines")
    if metrics is not None:
        from hicache.metrics.prometheus import exposition

        try:
            with open(args.metrics, "w", encoding="utf-8") as out:
                out.write(exposition(metrics))
        except OSError as exc:
            raise ConfigError(f"--metrics {args.metrics}: cannot write it ({exc})") from exc
        progress(f"metrics written to {args.metrics}")
    if args.plot is not None:
        from hicache.demo.plot import write_timeline

        write_timeline(timelines, args.plot)
        progress(f"timeline written to {args.plot}")
        if args.device != "cpu":
            progress(
                f"note: on {args.device} the timeline's times are the CPU's (kernel launches and "
                f"stream waits return at once), not the GPU's; see docs/demo.md"
            )
    if args.json:
        extra = {
            "storage": result["storage"],
            "served_tokens": result["served_tokens"],
            "runs": result["runs"],
        }
        sys.stdout.write(json.dumps({k: result[k] for k in KEYS} | extra))
        sys.stdout.write("\n")
    else:
        sys.stdout.write(_human(result))
    if result["tokens_identical"] and result["max_abs_diff"] <= MAX_ABS_DIFF:
        return 0
    sys.stderr.write(
        f"hicache: error: a cached run differed from its recompute (max |logit diff| "
        f"{result['max_abs_diff']:.3g}, greedy tokens "
        f"{'identical' if result['tokens_identical'] else 'different'})\n"
    )
    return 1


def _default_log() -> Path:
    return Path(tempfile.gettempdir()) / f"hicache-demo-{os.getpid()}.log"


def _human(r: dict[str, Any]) -> str:
    lines = [
        f"model   {r['model']}",
        f"device  {r['device']}, storage {r['storage']}",
        "",
        f"{'request':<10} {'tokens':>7} {'hit':>6} {'recompute ms':>13} {'host hit ms':>12} "
        f"{'storage hit ms':>15} {'max |diff|':>11} {'tokens':>7}",
    ]
    for run_ in r["runs"]:
        t = run_["ttft_ms"]
        stored = "n/a" if t["storage_hit"] is None else f"{t['storage_hit']:.1f}"
        lines.append(
            f"{run_['name']:<10} {run_['prompt_tokens']:>7} {run_['hit_tokens']:>6} "
            f"{t['recompute']:>13.1f} {t['host_hit']:>12.1f} {stored:>15} "
            f"{run_['max_abs_diff']:>11.2e} {'same' if run_['tokens_identical'] else 'DIFFER':>7}"
        )
    t = r["ttft_ms"]
    rec = t["recompute"]
    storage = (
        "n/a (--storage none)"
        if t["storage_hit"] is None
        else f"{t['storage_hit']:.1f} ms ({t['storage_hit'] / rec:.2f}x, prefetch included)"
    )
    lines += [
        "",
        f"median TTFT: recompute {rec:.1f} ms, host hit {t['host_hit']:.1f} ms "
        f"({t['host_hit'] / rec:.2f}x), storage hit {storage}",
        f"max |logit diff| {r['max_abs_diff']:.2e} (target <= 1e-5), greedy tokens "
        f"{'identical' if r['tokens_identical'] else 'DIFFER'}; exposed fraction "
        f"{r['exposed_fraction']:.3f} of the load's copy time",
        "tokens served by the cache per tier (all matches, prefetches' included): "
        + ", ".join(f"{t} {n}" for t, n in r["served_tokens"].items()),
        "",
        *FOOTER,
    ]
    return "\n".join(lines) + "\n"
