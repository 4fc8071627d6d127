"""What KV events add to the scheduler side's work (docs/vllm.md, "KV events").

``python -m tests.integrations.vllm.kv_events_cost [BLOCKS]``: plans the saves of one prompt of
BLOCKS full 16-token blocks (default 4096), settles them and takes the events, with the events
off and on (a Request stand-in with vLLM-shaped block hashes, vLLM's hash conversion), five
times each, interleaved; prints the medians and the difference per block.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import sys
import time
from types import SimpleNamespace

from hicache.integrations.vllm.events import TierEvents, describer
from hicache.integrations.vllm.plan import Event, Op
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.stats import ConnectorStats

BS = 16


def once(blocks: int, events_on: bool) -> float:
    rng = random.Random(0)
    tokens = [rng.randrange(1, 30000) for _ in range(BS * blocks + 1)]
    hashes = [hashlib.sha256(str(i).encode()).digest() for i in range(blocks)]
    requests = {"a": SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=None)}
    events = (
        TierEvents(describer(requests, BS, BS), block_size=BS, host_slots=blocks)  # type: ignore[arg-type]
        if events_on
        else None
    )
    side = SchedulerSide(
        block_size=BS,
        host_slots=blocks,
        store=None,
        store_keys=lambda _k: [],
        write_storage=False,
        save_decode=False,
        ranks=1,
        stats=ConnectorStats(),
        events=events,
    )
    side.match("a", tokens, 0)
    t0 = time.perf_counter()
    plan = side.build([Scheduled("a", tokens, 0, len(tokens))], lambda _r: list(range(blocks + 1)))
    side.on_events([Event(Op.SAVE, op.key, True) for op in plan.saves])
    if events is not None:
        events.take()
    return time.perf_counter() - t0


def main(blocks: int) -> None:
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(5):
        for on in (False, True):
            times[on].append(once(blocks, on))
    off, on = (statistics.median(times[k]) for k in (False, True))
    print(
        f"{blocks} blocks: events off {off * 1000:.1f} ms, on {on * 1000:.1f} ms "
        f"({on / off:.2f}x; {(on - off) / blocks * 1e6:.1f} us a block)"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
