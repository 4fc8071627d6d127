"""`hicache plan`: the host group plan of one rank of a model, as a table or as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hicache.bootstrap import bundled_models, load_model_spec, storage_settings
from hicache.cli._format import human_bytes
from hicache.cli._options import one_of
from hicache.domain import (
    BudgetSizing,
    ConfigError,
    DType,
    HostGroupPlan,
    Layout,
    Pinning,
    PlanSettings,
    PoolName,
    RatioSizing,
    check_host_memory,
    parse_size,
    plan_stack,
)
from hicache.domain.host_memory import KNOWN_BACKENDS
from hicache.domain.planner import DEFAULT_LAYOUT
from hicache.domain.sizing import DEFAULT_RESERVE_BYTES

MAX_RANKS_PER_HOST = 1 << 16


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="plan the host pools of one rank of a model",
        description="Plan the host (L2) pools of one tensor/pipeline-parallel rank of a model.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="path to a HuggingFace config.json (or its folder), or a bundled model: "
        + ", ".join(bundled_models()),
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--pp-rank", type=int, default=0, help="pipeline stage to plan")
    p.add_argument(
        "--pp-split",
        default="vllm",
        help="how --pp-size splits layers: one of vllm (its get_pp_indices), sglang",
    )
    p.add_argument(
        "--pp-start",
        type=int,
        default=None,
        help="first layer of the stage, as the serving engine runs it (with --pp-end)",
    )
    p.add_argument(
        "--pp-end",
        type=int,
        default=None,
        help="one past the stage's last layer, as the serving engine runs it (with --pp-start)",
    )
    p.add_argument("--page-size", type=int, default=64, help="tokens per page")
    p.add_argument(
        "--layout",
        default=DEFAULT_LAYOUT.value,
        help=f"host layout: {one_of(Layout)}",
    )
    p.add_argument(
        "--pool-layout",
        action="append",
        default=[],
        metavar="POOL=LAYOUT",
        help=f"layout for one pool, e.g. mamba=page_first; LAYOUT is {one_of(Layout)} (repeatable)",
    )
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--host-ratio",
        type=float,
        default=None,
        help="host capacity = device capacity x ratio (default: 2.0)",
    )
    size.add_argument(
        "--host-size", default=None, help="host byte budget per rank for all pools, e.g. 64GiB"
    )
    p.add_argument(
        "--capacity",
        action="append",
        default=[],
        metavar="POOL=UNITS",
        help="fixed host capacity of one pool in tokens or slots (repeatable)",
    )
    p.add_argument(
        "--device-tokens",
        type=int,
        default=65536,
        help="anchor capacity on the device in tokens",
    )
    p.add_argument("--device-slots", type=int, default=256, help="state slots on the device")
    p.add_argument(
        "--swa-tokens",
        type=int,
        default=None,
        help="sliding-window pool tokens on the device (default: --device-tokens)",
    )
    p.add_argument(
        "--storage-backend",
        default=None,
        help=f"storage backend: {one_of(sorted(KNOWN_BACKENDS))} (default: none)",
    )
    p.add_argument(
        "--storage-extra-config",
        default=None,
        help="backend extra config: JSON, or @file.json/.toml/.yaml",
    )
    p.add_argument(
        "--kv-dtype", default=None, help=f"KV dtype: {one_of(DType)} (default: the model's dtype)"
    )
    p.add_argument(
        "--ssm-dtype", default="fp32", help=f"recurrent temporal state dtype: {one_of(DType)}"
    )
    pin = p.add_mutually_exclusive_group()
    pin.add_argument(
        "--pinned",
        dest="pinned",
        action="store_const",
        const=Pinning.ON,
        help="page-lock host memory, needs a GPU (default: auto, only where a GPU is used)",
    )
    pin.add_argument(
        "--no-pinned",
        dest="pinned",
        action="store_const",
        const=Pinning.OFF,
        help="never page-lock host memory",
    )
    p.set_defaults(pinned=Pinning.AUTO)
    p.add_argument(
        "--host-available",
        default=None,
        help="check the plan against this much host memory, e.g. 512GiB",
    )
    p.add_argument(
        "--reserve", default=None, help="host memory kept free by the check (default: 10GiB)"
    )
    p.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="ranks that share the host in the check",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.set_defaults(handler=run)


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{flag} expects POOL=VALUE, got {item!r}")
        out[name.strip()] = value.strip()
    return out


def _units(text: str, pool: str) -> int:
    try:
        return int(text)
    except ValueError:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise ConfigError(
            f"--capacity {pool}= expects a whole number of units, got {shown!r}"
        ) from None


def settings_from_args(args: argparse.Namespace) -> PlanSettings:
    sizing: RatioSizing | BudgetSizing
    if args.host_size is not None:
        sizing = BudgetSizing(parse_size(args.host_size))
    else:
        sizing = RatioSizing(2.0 if args.host_ratio is None else args.host_ratio)
    capacities = {
        PoolName.parse(k): _units(v, k) for k, v in _pairs(args.capacity, "--capacity").items()
    }
    return PlanSettings(
        tp_size=args.tp,
        pp_size=args.pp_size,
        pp_rank=args.pp_rank,
        pp_split=args.pp_split,
        pp_start=args.pp_start,
        pp_end=args.pp_end,
        page_size=args.page_size,
        layout=Layout.parse(args.layout),
        pool_layouts={
            PoolName.parse(k): Layout.parse(v)
            for k, v in _pairs(args.pool_layout, "--pool-layout").items()
        },
        sizing=sizing,
        capacity_overrides=capacities,
        device_tokens=args.device_tokens,
        device_slots=args.device_slots,
        swa_tokens=args.swa_tokens,
        storage=storage_settings(args.storage_backend, args.storage_extra_config),
        kv_dtype=DType.parse(args.kv_dtype) if args.kv_dtype else None,
        ssm_dtype=DType.parse(args.ssm_dtype),
        pinned=args.pinned,
    )


def render_table(plan: HostGroupPlan) -> str:
    doc = plan.as_json()
    head = (
        f"{doc['model_type']}  archetype={doc['archetype']}  tp={doc['tp_size']}  "
        f"stage={doc['stage']}  transfer layers={doc['transfer_layers']}  "
        f"host memory={plan.host_memory}"
    )
    cols = (
        "pool",
        "role",
        "kind",
        "layers",
        "unit",
        "B/unit/layer",
        "page",
        "capacity",
        "bytes",
        "layout",
    )
    rows = [cols] + [
        (
            p["name"],
            p["role"],
            p["kind"],
            str(p["layers"]),
            p["unit"],
            str(p["bytes_per_unit_per_layer"]),
            str(p["page_size"]),
            str(p["capacity"]),
            human_bytes(p["bytes"]),
            p["layout"],
        )
        for p in doc["pools"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""]
    lines.extend(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
    lines.append("")
    lines.append(
        f"total host bytes: {doc['host_bytes_total']} ({human_bytes(doc['host_bytes_total'])})"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    spec = load_model_spec(args.model)
    plan = plan_stack(spec, settings_from_args(args))
    # --reserve is checked even without --host-available: a bad flag is never ignored.
    reserve = parse_size(args.reserve) if args.reserve is not None else DEFAULT_RESERVE_BYTES
    if not 1 <= args.ranks_per_host <= MAX_RANKS_PER_HOST:
        raise ConfigError(
            f"--ranks-per-host must be in [1, {MAX_RANKS_PER_HOST}], got {args.ranks_per_host}"
        )
    if args.host_available is not None:
        check_host_memory(
            plan.nbytes,
            parse_size(args.host_available),
            reserve_bytes=reserve,
            ranks_on_host=args.ranks_per_host,
        )
    if args.json:
        sys.stdout.write(json.dumps(plan.as_json(), indent=2) + "\n")
    else:
        sys.stdout.write(render_table(plan) + "\n")
    return 0
