"""Whether a freshly set-up Mooncake client can store anything: one small probe object.

- MooncakeSegmentError: a StoreError raised at open when no mounted segment takes the probe;
  its message names the cause (no segment mounted / segment full, or a segment whose node is
  unreachable), the sizes involved and what to check.
- check_segment(client, config, deadline): put a probe object of PROBE_BYTES under a key of its
  own, from registered memory (the same zero-copy call a page put makes), then remove it.
- probe_or_close(client, config, deadline): check_segment on a daemon thread, waited for until
  the deadline; the client is closed when the probe fails (or, if it overran, once it ends).

Why: a Mooncake client sets up fine against a master that has no segment mounted (no storage
node, or a node the master dropped after its ``--client_ttl`` without a heartbeat), or whose
segments are full of objects it may not remove (objects read within the master's
``--default_kv_lease_ttl``). Then every put answers NO_AVAILABLE_HANDLE, which the store
reports as FULL: a store that opened and silently keeps nothing. The probe turns that into an
error at open (docs/storage-mooncake.md, "A store without its segment").
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from typing import Any

import numpy as np

from hicache.adapters.storage.mooncake_config import MooncakeConfig
from hicache.domain import StoreError

PROBE_BYTES = 4096
RETRY_PAUSE_S = 0.2
# Mooncake's ErrorCode values the probe tells apart (mooncake-store/include/types.h).
_NO_SPACE = {-200: "NO_AVAILABLE_HANDLE", -101: "SEGMENT_NOT_FOUND"}
_CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -703: "REPLICA_IS_NOT_READY",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    **_NO_SPACE,
}


class MooncakeSegmentError(StoreError):
    """The Mooncake client set up, but no mounted segment stores a probe object."""


def _code(code: int) -> str:
    name = _CODE_NAMES.get(code)
    return f"{name} ({code})" if name else f"code {code}"


def check_segment(client: Any, config: MooncakeConfig, deadline: float) -> None:
    """Put and remove one PROBE_BYTES object; MooncakeSegmentError unless the put succeeds.

    NO_AVAILABLE_HANDLE / SEGMENT_NOT_FOUND fail at once (no segment has room); other codes
    (a segment whose node is unreachable answers TRANSFER_FAIL until the master drops it) are
    retried until ``deadline`` (monotonic), then fail naming the last code.
    """
    buffer = np.full(PROBE_BYTES, 0x5A, dtype=np.uint8)
    ptr = int(buffer.ctypes.data)
    rc = client.register_buffer(ptr, PROBE_BYTES)
    if rc != 0:
        raise MooncakeSegmentError(
            f"Mooncake refused to register the {PROBE_BYTES} B probe buffer: return code {rc}"
        )
    try:
        _put_probe(client, config, ptr, deadline)
    finally:
        with contextlib.suppress(Exception):
            client.unregister_buffer(ptr)


def _put_probe(client: Any, config: MooncakeConfig, ptr: int, deadline: float) -> None:
    key = f"hicache-probe/{uuid.uuid4().hex}"
    tries = 0
    while True:
        tries += 1
        code = int(client.batch_put_from_multi_buffers([key], [[ptr]], [[PROBE_BYTES]])[0])
        if code == 0:
            with contextlib.suppress(Exception):
                client.batch_remove([key])  # never read: no lease holds it
            return
        if code in _NO_SPACE:
            raise MooncakeSegmentError(_no_space(config, code))
        if time.monotonic() + RETRY_PAUSE_S >= deadline:
            raise MooncakeSegmentError(_unreachable(config, code, tries))
        time.sleep(RETRY_PAUSE_S)


def _no_space(config: MooncakeConfig, code: int) -> str:
    own = config.global_segment_size
    return (
        f"the Mooncake cluster of the master at {config.master_server_address} has no mounted "
        f"segment with room for a {PROBE_BYTES} B probe object (put answered {_code(code)}): "
        "every put would answer FULL. Check that a storage node is running and mounted its "
        "segment (mooncake_client --global_segment_size=...; the master drops a node that "
        "misses heartbeats for its --client_ttl), or give this client a segment of its own "
        f"(global_segment_size is {own} B here, from {config.source}); a segment full of "
        "objects read within the master's --default_kv_lease_ttl cannot take new ones either"
    )


def _unreachable(config: MooncakeConfig, code: int, tries: int) -> str:
    return (
        f"the Mooncake cluster of the master at {config.master_server_address} did not store a "
        f"{PROBE_BYTES} B probe object within setup_timeout_s {config.setup_timeout_s:g} s "
        f"({tries} tries, last answer {_code(code)}): the segment the master chose is not "
        "reachable (a storage node that died or stopped; the master drops it after its "
        "--client_ttl), or this client's local_hostname "
        f"{config.local_hostname!r} is not an address the node can reach"
    )


def probe_or_close(client: Any, config: MooncakeConfig, deadline: float) -> None:
    """check_segment, waiting no later than ``deadline``; the client is closed if it fails."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            check_segment(client, config, deadline)
        except BaseException as e:
            errors.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="hicache-mooncake-probe", daemon=True).start()
    if not done.wait(max(deadline - time.monotonic(), 0.0) + 1.0):
        # A put blocked natively (a master that stopped answering): close when it returns.
        threading.Thread(target=_close_after, args=(done, client), daemon=True).start()
        raise MooncakeSegmentError(
            f"the Mooncake cluster of the master at {config.master_server_address} did not "
            f"answer a {PROBE_BYTES} B probe put by the setup deadline (setup_timeout_s "
            f"{config.setup_timeout_s:g} s, from {config.source})"
        )
    if errors:
        with contextlib.suppress(Exception):
            client.close()
        if isinstance(errors[0], StoreError):
            raise errors[0]
        raise MooncakeSegmentError(f"the Mooncake probe put failed: {errors[0]}") from errors[0]


def _close_after(done: threading.Event, client: Any) -> None:
    done.wait()
    with contextlib.suppress(Exception):
        client.close()
