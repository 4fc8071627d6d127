"""MooncakeStore: the storage port on the real Mooncake Store client (MooncakeDistributedStore).

- MooncakeStore: open(config) checks that the master accepts TCP connections, sets the client
  up within the setup deadline, then puts and removes a small probe object
  (mooncake_probe.check_segment: MooncakeSegmentError when no mounted segment takes it, instead
  of a store whose every put answers FULL); register(regions) registers host memory once; exists /
  get / put / remove are zero-copy batch calls straight into and out of pool pages (one object
  per page per pool, named ``str(StoreKey)``); health; close.
- status_of_get / status_of_put / status_of_remove: Mooncake's return codes as StoreStatus.
- buffer_address: the address of a memoryview's first byte (no copy).
- open_mooncake_store: settings from the extra config, a file or the environment, then open.

Every blocking client call runs on a daemon worker thread; the caller waits until its deadline
and no longer. Keys not finished by then are TRANSIENT (exists: False). A call that overran
keeps running natively (a stopped storage node holds a get for Mooncake's own 30 s transfer
timeout) and may still write the buffers of that batch: health() is unhealthy until it ends.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import numpy as np

from hicache.adapters.storage.mooncake_config import MooncakeConfig, load_mooncake_config
from hicache.adapters.storage.mooncake_memory import provide_host_memory as provide_memory
from hicache.adapters.storage.mooncake_probe import probe_or_close
from hicache.domain import ConfigError, StoreError
from hicache.domain.storage import (
    PageBuffer,
    StoreHealth,
    StoreKey,
    StoreStatus,
    check_batch,
    check_deadline,
    check_keys,
)

NAME = "mooncake"
INSTALL_HINT = (
    "pip install 'hicache[mooncake]' (the wheel mooncake-transfer-engine-non-cuda; it needs "
    "the Debian package libibverbs1 even for TCP: apt-get install libibverbs1)"
)

# Mooncake's ErrorCode (mooncake-store/include/types.h) for the codes it answers per key.
OK = 0
INTERNAL_ERROR = -1
SEGMENT_NOT_FOUND = -101
NO_AVAILABLE_HANDLE = -200
INVALID_KEY = -400
INVALID_PARAMS = -600
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
RPC_FAIL = -900

_FULL = frozenset({NO_AVAILABLE_HANDLE, SEGMENT_NOT_FOUND})
_INVALID = frozenset({INVALID_KEY, INVALID_PARAMS})

T = TypeVar("T")


class _Client(Protocol):
    """The slice of mooncake.store.MooncakeDistributedStore this adapter calls."""

    def setup(self, *args: Any) -> int: ...
    def register_buffer(self, ptr: int, size: int) -> int: ...
    def unregister_buffer(self, ptr: int) -> int: ...
    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_get_into_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_put_from_multi_buffers(
        self, keys: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[int]: ...
    def batch_remove(self, keys: list[str]) -> list[int]: ...
    def get_size(self, key: str) -> int: ...
    def health_check(self) -> int: ...
    def close(self) -> int: ...


def status_of_get(code: int, expected: int) -> StoreStatus:
    """A get's answer for one key: the bytes read (>= 0) or an error code."""
    if code >= 0:
        return StoreStatus.OK if code == expected else StoreStatus.INVALID
    if code == OBJECT_NOT_FOUND:
        return StoreStatus.MISS
    if code in _INVALID:
        return StoreStatus.INVALID  # INVALID_PARAMS: the object is larger than the buffer
    return StoreStatus.TRANSIENT  # transfer or RPC failure, replica not ready, lease expired


def status_of_put(code: int) -> StoreStatus:
    """A put's answer for one key (an object already there holds the same bytes: OK)."""
    if code in (OK, OBJECT_ALREADY_EXISTS):
        return StoreStatus.OK
    if code in _FULL:
        return StoreStatus.FULL
    if code in _INVALID:
        return StoreStatus.INVALID
    return StoreStatus.TRANSIENT


def status_of_remove(code: int) -> StoreStatus:
    """A remove's answer for one key (not held: OK; being read under a lease: TRANSIENT)."""
    if code in (OK, OBJECT_NOT_FOUND):
        return StoreStatus.OK
    if code in _INVALID:
        return StoreStatus.INVALID
    return StoreStatus.TRANSIENT


def buffer_address(view: memoryview) -> int:
    """The address of ``view``'s first byte; ConfigError unless it is C-contiguous."""
    if not isinstance(view, memoryview):
        raise ConfigError(f"expected a memoryview of host memory, got {type(view).__name__}")
    if not view.c_contiguous:
        raise ConfigError("a store buffer must be a C-contiguous memoryview")
    if view.nbytes == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _probe(host: str, port: int, timeout: float) -> str | None:
    """None when host:port accepts a TCP connection within ``timeout``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=max(timeout, 0.01)):
            return None
    except OSError as e:
        return e.strerror or type(e).__name__


class _Call:
    """One blocking client call on its own daemon thread."""

    def __init__(self, fn: Callable[[], object], label: str) -> None:
        self.label = label
        self.done = threading.Event()
        self.result: object = None
        self.error: BaseException | None = None
        self._fn = fn
        threading.Thread(target=self._run, name=f"hicache-mooncake-{label}", daemon=True).start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as e:
            self.error = e
        finally:
            self.done.set()


class MooncakeStore:
    """The Store port on one Mooncake client. Thread-safe; build it with MooncakeStore.open."""

    def __init__(self, client: _Client, config: MooncakeConfig) -> None:
        # Use MooncakeStore.open; this wraps a client that is already set up.
        self.config = config
        self._client: _Client | None = client
        self._lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []  # (start, end) of registered host memory
        self._overran: list[_Call] = []
        self._withdraw: Callable[[], None] | None = None

    @property
    def name(self) -> str:
        return NAME

    def raw_client(self) -> Any:
        """The Mooncake client itself, for ``bench storage``'s baseline (its own zero-copy batch
        calls on the same registered pages); StoreError once closed."""
        return self._live()

    @classmethod
    def open(cls, config: MooncakeConfig, *, provide_host_memory: bool = True) -> MooncakeStore:
        """A client set up against ``config``'s master; StoreError within setup_timeout_s.

        With ``provide_host_memory`` the store serves host memory of kind store:mooncake
        (registered with it) until it is closed; ConfigError if another store serves it.
        """
        try:
            from mooncake.store import MooncakeDistributedStore
        except (ImportError, OSError) as e:  # OSError: libibverbs.so.1 missing
            raise StoreError(f"the Mooncake client cannot be imported ({e}): {INSTALL_HINT}") from e
        deadline = time.monotonic() + config.setup_timeout_s
        host, port = config.master_host_port
        why = _probe(host, port, config.setup_timeout_s)
        if why is not None:
            raise StoreError(
                f"the mooncake_master at {config.master_server_address} (from {config.source}) "
                f"does not accept TCP connections: {why}"
            )
        client = cast(_Client, MooncakeDistributedStore())
        args = (
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_server_address,
        )
        call = _Call(lambda: client.setup(*args), "setup")
        if not call.done.wait(max(deadline - time.monotonic(), 0.0)):
            # The client goes on retrying natively; close it whenever it gives up.
            threading.Thread(target=_close_when_done, args=(call, client), daemon=True).start()
            raise StoreError(
                f"the mooncake_master at {config.master_server_address} accepted a TCP "
                f"connection but the client was not set up within {config.setup_timeout_s:g} s "
                f"(setup_timeout_s, from {config.source})"
            )
        if call.error is not None or call.result != 0:
            with contextlib.suppress(Exception):
                client.close()
            what = call.error if call.error is not None else f"return code {call.result}"
            raise StoreError(
                f"setting up the Mooncake client against {config.master_server_address} "
                f"({config.protocol}, device {config.device_name or 'auto'}, metadata "
                f"{config.metadata_server}) failed: {what}"
            )
        probe_or_close(client, config, max(deadline, time.monotonic() + config.timeout_s))
        store = cls(client, config)
        if provide_host_memory:
            try:
                store._withdraw = provide_memory(store)
            except BaseException:
                store.close()
                raise
        return store

    # -- the port ------------------------------------------------------------------------

    def register(self, regions: Sequence[memoryview]) -> None:
        """Register host memory with the transfer engine once; ranges already inside a
        registered one are skipped. StoreError names a range Mooncake refused."""
        client = self._live()
        for view in regions:
            start = buffer_address(view)
            end = start + view.nbytes
            if view.nbytes == 0:
                continue
            with self._lock:
                if self._covered(start, end):
                    continue
                rc = client.register_buffer(start, view.nbytes)
                if rc != 0:
                    raise StoreError(
                        f"Mooncake refused to register {view.nbytes} B of host memory at "
                        f"0x{start:x}: return code {rc}"
                    )
                self._registered.append((start, end))

    def unregister(self, address: int) -> None:
        """Forget the registered range that starts at ``address`` (if any)."""
        with self._lock:
            ranges = [r for r in self._registered if r[0] == address]
            if not ranges:
                return
            self._registered = [r for r in self._registered if r[0] != address]
            client = self._client
        if client is not None:
            client.unregister_buffer(address)

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        check_keys(keys)
        deadline = check_deadline(deadline)
        if not keys:
            return []
        client = self._client
        if client is None:
            return [False] * len(keys)
        names = [str(k) for k in keys]
        done, codes = self._run(lambda: client.batch_is_exist(names), deadline, "exists")
        if not done:
            return [False] * len(keys)
        return [c == 1 for c in cast(list[int], codes)]

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self._transfer("get", keys, buffers, deadline)

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self._transfer("put", keys, buffers, deadline)

    def remove(self, keys: Sequence[StoreKey]) -> list[StoreStatus]:
        check_keys(keys)
        if not keys:
            return []
        client = self._client
        if client is None:
            return [StoreStatus.FATAL] * len(keys)
        names = [str(k) for k in keys]
        done, codes = self._run(lambda: client.batch_remove(names), None, "remove")
        if not done:
            return [StoreStatus.TRANSIENT] * len(keys)
        return [status_of_remove(c) for c in cast(list[int], codes)]

    def health(self) -> StoreHealth:
        client = self._client
        if client is None:
            return StoreHealth(False, "closed")
        with self._lock:
            self._overran = [c for c in self._overran if not c.done.is_set()]
            stuck = [c.label for c in self._overran]
        if stuck:
            return StoreHealth(
                False,
                f"{len(stuck)} Mooncake call(s) overran their deadline and still run "
                f"({', '.join(stuck)}); their buffers may still be written",
            )
        done, rc = self._run(client.health_check, None, "health")
        if not done:
            return StoreHealth(
                False, f"health check did not answer within {self.config.timeout_s:g} s"
            )
        if rc == 0:
            return StoreHealth(True)
        why = {1: "client not set up or closed", 2: "master unreachable"}.get(cast(int, rc), "")
        return StoreHealth(
            False, f"master {self.config.master_server_address}: {why or f'health code {rc}'}"
        )

    def close(self) -> None:
        """Unregister host memory and close the client (after calls that overran end, up to
        setup_timeout_s). Idempotent; later calls answer FATAL (exists: False)."""
        with self._lock:
            client, self._client = self._client, None
            ranges, self._registered = self._registered, []
            stuck = list(self._overran)
            withdraw, self._withdraw = self._withdraw, None
        if withdraw is not None:
            withdraw()
        if client is None:
            return
        wait_until = time.monotonic() + self.config.setup_timeout_s
        for call in stuck:
            call.done.wait(max(wait_until - time.monotonic(), 0.0))
        if any(not c.done.is_set() for c in stuck):
            return  # a native call still runs: closing under it could crash; the OS reclaims
        for start, _ in ranges:
            with contextlib.suppress(Exception):
                client.unregister_buffer(start)
        with contextlib.suppress(Exception):
            client.close()

    # -- internals -----------------------------------------------------------------------

    def _live(self) -> _Client:
        client = self._client
        if client is None:
            raise StoreError("the Mooncake store is closed")
        return client

    def _covered(self, start: int, end: int) -> bool:
        return any(s <= start and end <= e for s, e in self._registered)

    def _run(
        self, fn: Callable[[], T], deadline: float | None, label: str
    ) -> tuple[bool, T | None]:
        """Run ``fn`` on a worker; (True, result) or (False, None) past the deadline."""
        if deadline is None:
            deadline = time.monotonic() + self.config.timeout_s
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False, None
        call = _Call(fn, label)
        if not call.done.wait(remaining):
            with self._lock:
                self._overran.append(call)
            return False, None
        if call.error is not None:
            raise StoreError(f"the Mooncake client failed in {label}: {call.error}") from call.error
        return True, cast(T, call.result)

    def _transfer(
        self,
        op: str,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        deadline: float | None,
    ) -> list[StoreStatus]:
        check_batch(keys, buffers)
        deadline = check_deadline(deadline)
        out = [StoreStatus.FATAL] * len(keys)
        client = self._client
        if client is None or not keys:
            return out
        names: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        index: list[int] = []
        for i, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
            seg_ptrs, seg_sizes = self._segments(buffer, writable=op == "get")
            if seg_ptrs is None:
                out[i] = StoreStatus.INVALID  # outside registered memory, or empty
                continue
            names.append(str(key))
            ptrs.append(seg_ptrs)
            sizes.append(seg_sizes)
            index.append(i)
        if not names:
            return out

        def call() -> list[int]:
            if op == "get":
                return _get_checked(client, names, ptrs, sizes)
            return list(client.batch_put_from_multi_buffers(names, ptrs, sizes))

        done, codes = self._run(call, deadline, op)
        for j, i in enumerate(index):
            if not done or codes is None:
                out[i] = StoreStatus.TRANSIENT
            elif op == "get":
                out[i] = status_of_get(codes[j], sum(sizes[j]))
            else:
                out[i] = status_of_put(codes[j])
        return out

    def _segments(
        self, buffer: PageBuffer, *, writable: bool
    ) -> tuple[list[int] | None, list[int]]:
        """The (address, size) lists of a page's segments; None when one lies outside
        registered memory (the transfer engine would refuse or, over RDMA, fault) or, for a
        get, is read-only."""
        seg_ptrs: list[int] = []
        seg_sizes: list[int] = []
        for view in buffer:
            if view.nbytes == 0:
                continue
            if writable and view.readonly:
                return None, seg_sizes
            start = buffer_address(view)
            seg_ptrs.append(start)
            seg_sizes.append(view.nbytes)
        with self._lock:
            ok = bool(seg_ptrs) and all(
                self._covered(p, p + n) for p, n in zip(seg_ptrs, seg_sizes, strict=True)
            )
        return (seg_ptrs if ok else None), seg_sizes


def _get_checked(
    client: _Client, names: list[str], ptrs: list[list[int]], sizes: list[list[int]]
) -> list[int]:
    """batch_get_into_multi_buffers, then the size of each key that failed to transfer.

    Mooncake answers TRANSFER_FAIL both for a lost node and for buffers larger than the
    object; the object's size tells them apart (a differing size is INVALID, a vanished
    object a MISS).
    """
    codes = list(client.batch_get_into_multi_buffers(names, ptrs, sizes))
    for j, code in enumerate(codes):
        if code == TRANSFER_FAIL:
            size = client.get_size(names[j])
            if size == OBJECT_NOT_FOUND:
                codes[j] = OBJECT_NOT_FOUND
            elif size >= 0 and size != sum(sizes[j]):
                codes[j] = INVALID_PARAMS
    return codes


def _close_when_done(call: _Call, client: _Client) -> None:
    call.done.wait()
    with contextlib.suppress(Exception):
        client.close()


def open_mooncake_store(
    extra_config: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> MooncakeStore:
    """Read the settings (extra config, else MOONCAKE_CONFIG_PATH, else MOONCAKE_*) and open."""
    return MooncakeStore.open(load_mooncake_config(extra_config, environ))
