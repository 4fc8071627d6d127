"""Runs a real vLLM (in-process engine) with HiCacheConnector and vLLM's ZMQ KV-event publisher,
subscribed to by a ZMQ SUB socket of this process, and prints what was published as JSON.

``python -m tests.integrations.vllm.kv_events_runner SPEC.json`` where SPEC is {"model":
folder, "store": folder, "host_gib": GiB, "prompts": [[token ids], ...], "phases": [[prompt
indexes to generate, one after the other], ...]}. Each phase starts one LLM over the same
store (the second is a restart); after each request it lets the connector settle (steps of a
one-token request until no host page is pinned: every store write reported); it then reads
the pages each tier holds (for every prompt's full blocks, whether the host tier holds the
page and whether the store does), then the published batches: live from the SUB socket until the
publisher has been quiet for a while, and every batch of the publisher's replay buffer (its
``replay_endpoint``), as a consumer recovers batches it missed: a ZMQ subscriber can miss the
first messages of a fresh connection.

The last stdout line is ``HICACHE-RESULT {"phases": [{"payloads": [base64 msgpack KVEventBatch,
...] (in sequence order), "live": how many came from the SUB socket, "host": [page key hex,
...], "store": [page key hex, ...], "block_size": n}, ...]}``.
The SUB socket binds a free port; vLLM's publisher connects to it (an endpoint without "*").
"""

from __future__ import annotations

import base64
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.integrations.vllm.runner import _llm

QUIET_MS = 3000  # the publisher sends within ~0.1 s of a step; this much silence: all is read
TOPIC = "kv-events"


def _drain(sub: Any) -> dict[int, bytes]:
    payloads: dict[int, bytes] = {}
    while sub.poll(QUIET_MS):
        _topic, seq, payload = sub.recv_multipart()
        payloads[int.from_bytes(seq, "big")] = payload
    return payloads


def _replay(ctx: Any, endpoint: str) -> dict[int, bytes]:
    """Every batch in the publisher's replay buffer (vLLM's protocol: an 8-byte big-endian
    start sequence; batches as (topic, seq, payload); an empty payload with seq -1 ends)."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    payloads: dict[int, bytes] = {}
    while True:
        if not sock.poll(60_000):
            raise RuntimeError(f"no replay from {endpoint}")
        _, _topic, seq, payload = sock.recv_multipart()
        number = int.from_bytes(seq, "big", signed=True)
        if number < 0:
            break
        payloads[number] = payload
    sock.close(linger=0)
    return payloads


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _settle(llm: Any, params: Any) -> None:
    """One-token requests (no full block: nothing saved) until no host page is pinned: every
    store write the connector started has been reported to the scheduler."""
    import time

    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_role.side
    for _ in range(200):
        if not len(side.index.pins):
            return
        llm.generate([{"prompt_token_ids": [7]}], params, use_tqdm=False)
        time.sleep(0.05)
    raise RuntimeError(f"the connector did not settle: {side.index!r}")


def _held(llm: Any, prompts: list[list[int]], block_size: int) -> tuple[list[str], list[str]]:
    from hicache.domain.keys import chain_keys

    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    side = connector.scheduler_role.side
    keys = list(dict.fromkeys(k for p in prompts for k in chain_keys(p, block_size)))
    in_store = side.store.exists_each(keys).value if side.store is not None else []
    host = [k.hex() for k in keys if side.index.lookup(k) is not None]
    store = [k.hex() for k, ok in zip(keys, in_store, strict=True) if ok]
    return host, store


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import zmq
    from vllm import SamplingParams
    from vllm.config import KVEventsConfig

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    connector = {
        "host_gib": spec["host_gib"],
        "storage_backend": "directory",
        "storage_path": spec["store"],
        "load_policy": "always",  # every hit loaded, whatever this machine's timings
    }
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts: list[list[int]] = spec["prompts"]
    out: list[dict[str, Any]] = []
    for phase in spec["phases"]:
        replay = f"tcp://127.0.0.1:{_free_port()}"
        events = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://127.0.0.1:{port}",  # no "*": vLLM's PUB connects to the SUB
            replay_endpoint=replay,
            topic=TOPIC,
        )
        llm: Any = _llm(spec["model"], connector, extra={"kv_events_config": events})
        block_size = llm.llm_engine.vllm_config.cache_config.block_size
        for i in phase:  # one after the other, settled: the saves and evictions are known
            llm.generate([{"prompt_token_ids": prompts[i]}], params, use_tqdm=False)
            _settle(llm, params)
        host, store = _held(llm, prompts, block_size)
        live = _drain(sub)
        payloads = {**_replay(ctx, replay), **live}
        out.append(
            {
                "payloads": [base64.b64encode(payloads[n]).decode() for n in sorted(payloads)],
                "live": len(live),
                "host": host,
                "store": store,
                "block_size": block_size,
            }
        )
        del llm
        gc.collect()
    sub.close(linger=0)
    return {"phases": out}


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = run(json.loads(Path(sys.argv[1]).read_text()))
    print("HICACHE-RESULT " + json.dumps(result), flush=True)
    os._exit(0)
