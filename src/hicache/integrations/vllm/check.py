"""Check a ``kv_connector_extra_config`` without starting vLLM.

    python -m hicache.integrations.vllm.check '{"host_gib": 8, "storage_backend": "directory",
                                               "storage_path": "/mnt/kv"}'

Parses the JSON text (a key given twice, Infinity or NaN is refused), then builds the
connector's settings exactly as HiCacheConnector does (ConnectorSettings.from_extra_config,
with ``$HICACHE_CONFIG`` and the ``HICACHE_*`` variables filling in what it leaves out). Exit 0
and the resolved settings as one JSON document on stdout; exit 2 and one line naming the bad
key on stderr (or a ``VLLM_KV_CACHE_LAYOUT`` the connector cannot copy: kv_layouts). Nothing
is allocated and no store is opened. Imports no vLLM.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from hicache.domain import ConfigError
from hicache.domain.limits import parse_json
from hicache.integrations.vllm.kv_layouts import check_layout_env
from hicache.integrations.vllm.settings import SOURCE, ConnectorSettings


def check(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(
            "usage: python -m hicache.integrations.vllm.check '<kv_connector_extra_config JSON>'",
            file=sys.stderr,
        )
        return 2
    try:
        config = parse_json(argv[0], SOURCE)
        if not isinstance(config, dict):
            raise ConfigError(f"{SOURCE}: expected a JSON object, got {type(config).__name__}")
        settings = ConnectorSettings.from_extra_config(config)
        check_layout_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    resolved = {
        "host_gib": settings.host_gib,
        "host_bytes": settings.host_bytes,
        "storage_backend": settings.storage_backend,
        "storage_path": settings.storage_path,
        "storage_extra_config": dict(settings.storage_extra_config),
        "write_policy": settings.write_policy,
        "save_decode": settings.save_decode,
        "metrics_port": settings.metrics_port,
        "metrics": settings.metrics,
        "copy_backend": settings.copy_backend,
        "deadline_s": settings.deadline_s,
        "grace_s": settings.grace_s,
    }
    print(json.dumps(resolved, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(check(sys.argv[1:]))
