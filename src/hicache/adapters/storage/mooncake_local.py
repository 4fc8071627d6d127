"""A local Mooncake cluster of real processes, for tests and benches: a master and a storage node.

- mooncake_binary: the path of a binary the Mooncake wheel ships (mooncake_master,
  mooncake_client), or a StoreError saying how to install it.
- free_port: a TCP port of 127.0.0.1 that nothing listens on now.
- wait_listening: wait until a TCP port accepts connections (or the process died, or time ran out).
- owns_listener: whether a process itself holds the socket listening on a port (from /proc).
- LocalMooncake: a started cluster: its master address, the pids, the extra config that reaches
  it, start_master / start_node, kill_node / kill_master to inject faults, close() that stops
  every process by pid. A process counts as started once it holds its listening socket itself;
  one that lost its port to another process between free_port() and its bind is started again
  on fresh ports. Started from the main
  thread on Linux, the processes get SIGKILL when the process that started them dies.
- local_mooncake: the context manager that starts one on free 127.0.0.1 ports and always stops
  it, leaving no process behind.
- mooncake_store: a MooncakeStore on the cluster the settings name, or, when none names a
  master, on a local cluster started for it (what `hicache bench storage --store mooncake` needs);
  closes the store and stops what it started.
- open_mooncake_or_local: the same as one Store whose close() also stops the local cluster (the
  "mooncake" factory of hicache.bootstrap.storage).

The storage node is Mooncake's standalone client (``mooncake_client``): it mounts
``segment_bytes`` of its memory into the cluster, so pages put by a hicache process with a
zero-size segment live in the node, and killing the node loses them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from hicache.adapters.storage.delegating import DelegatingStore
from hicache.adapters.storage.mooncake import MooncakeStore
from hicache.adapters.storage.mooncake_config import load_mooncake_config, names_master
from hicache.domain import ConfigError, StoreError
from hicache.domain.storage import Store

DEFAULT_SEGMENT_BYTES = 256 << 20
START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0
START_TRIES = 3  # a port taken between free_port() and the bind: try fresh ports


def mooncake_binary(name: str) -> Path:
    """The path of ``name`` from the installed Mooncake wheel, made executable."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise StoreError(
            f"the Mooncake binary {name} is not installed: pip install 'hicache[mooncake]' "
            "(the wheel mooncake-transfer-engine-non-cuda; it needs the Debian package "
            "libibverbs1 even for TCP)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / name
        if path.is_file():
            if not os.access(path, os.X_OK):
                path.chmod(path.stat().st_mode | 0o111)
            return path
    raise StoreError(f"the installed Mooncake wheel has no {name} binary")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening(port: int, deadline: float, proc: subprocess.Popen[bytes] | None = None) -> bool:
    """Whether 127.0.0.1:``port`` accepts connections before ``deadline`` (monotonic).

    Gives up early (False) when ``proc`` exits meanwhile.
    """
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return True
        time.sleep(0.05)
    return False


def _stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    """Stop one process by its pid: ``sig``, then SIGKILL after STOP_TIMEOUT_S; reap it."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def listening_inodes(port: int) -> set[str] | None:
    """The socket inodes listening on TCP ``port`` (any address), or None without /proc."""
    found: set[str] = set()
    seen = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            cols = row.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; column 9 is the inode.
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rpartition(":")[2], 16) == port:
                found.add(cols[9])
    return found if seen else None


def owns_listener(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` holds a socket listening on ``port`` (None: cannot tell)."""
    inodes = listening_inodes(port)
    if inodes is None:
        return None
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:[") and link[8:-1] in inodes:
                return True
    return False


def _started(proc: subprocess.Popen[bytes], port: int, deadline: float) -> bool:
    """Whether ``proc`` itself listens on ``port`` before ``deadline``: not merely whether the
    port accepts connections, which another process that took the port between free_port()
    and ``proc``'s bind would also do (``proc`` then exits, later)."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        owns = owns_listener(proc.pid, port)
        if owns is None:  # no /proc: the port answering is all there is to go by
            return wait_listening(port, deadline, proc)
        if owns:
            return True
        time.sleep(0.05)
    return False


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get SIGKILL when this process dies, or None.

    Linux only, and only from the main thread: the signal follows the thread that forked, and
    the main thread ends only with the process. Without it, a bench killed with SIGKILL (or a
    test runner's hard timeout) left its master and storage node running, their segment's
    memory held, until someone killed them by hand.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(1)

    return preexec


class LocalMooncake:
    """A running local cluster; build it with local_mooncake()."""

    def __init__(
        self,
        log_dir: Path,
        segment_bytes: int,
        *,
        lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = None,
    ) -> None:
        self.log_dir = log_dir
        self.segment_bytes = segment_bytes
        # The master's --default_kv_lease_ttl (None: Mooncake's 10 s). Not shortened by
        # default: a get whose transfer outlasts the lease answers LEASE_EXPIRED (-707), which
        # a 500 ms lease did for 256 MiB batches on a loaded machine.
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s  # the master's --client_ttl (None: Mooncake's 10 s)
        self.master_port = 0
        self.node_port = 0
        self._master: subprocess.Popen[bytes] | None = None
        self._node: subprocess.Popen[bytes] | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.master_port}"

    @property
    def pids(self) -> list[int]:
        """The pids of the processes this cluster started and has not reaped yet."""
        return [p.pid for p in (self._master, self._node) if p is not None and p.poll() is None]

    def extra_config(self, **overrides: object) -> dict[str, object]:
        """The extra config of a hicache client of this cluster (TCP, no segment of its own)."""
        config: dict[str, object] = {
            "master_server_address": self.master_address,
            "metadata_server": "P2PHANDSHAKE",
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0,
            "local_buffer_size": 16 << 20,
        }
        config.update(overrides)
        return config

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the master, then the storage node; StoreError (with the logs' tail) if either
        does not listen within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self.start_master(timeout_s)
        self.start_node(deadline - time.monotonic())

    def start_master(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the master alone (a cluster with no segment until start_node) on fresh ports.

        A port another process took between free_port() and the master's bind makes the master
        exit: it is started again on other ports, up to START_TRIES times.
        """
        deadline = time.monotonic() + timeout_s
        for _ in range(START_TRIES):
            self.master_port = free_port()
            argv = [
                str(mooncake_binary("mooncake_master")),
                f"--rpc_port={self.master_port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={free_port()}",
                "--metrics_host=127.0.0.1",
                "--enable_metric_reporting=false",
                "--rpc_thread_num=2",
            ]
            if self.lease_ttl_ms is not None:
                argv.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
            if self.client_ttl_s is not None:
                argv.append(f"--client_ttl={self.client_ttl_s}")
            self._master = self._spawn("master", argv)
            if _started(self._master, self.master_port, deadline):
                return
            _stop(self._master)
            if time.monotonic() >= deadline:
                break
        raise StoreError(f"mooncake_master did not start: {self._tail('master')}")

    def start_node(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start (or restart after kill_node) the storage node on a fresh port."""
        _stop(self._node)
        deadline = time.monotonic() + max(timeout_s, 0.5)
        for _ in range(START_TRIES):
            self.node_port = free_port()
            self._node = self._spawn(
                "node",
                [
                    str(mooncake_binary("mooncake_client")),
                    f"--master_server_address={self.master_address}",
                    "--metadata_server=P2PHANDSHAKE",
                    "--host=127.0.0.1",
                    f"--port={self.node_port}",
                    f"--global_segment_size={self.segment_bytes}",
                    "--protocol=tcp",
                ],
            )
            # The node listens only once its segment is mounted (setup, then its RPC server).
            if _started(self._node, self.node_port, deadline):
                return
            _stop(self._node)
            if time.monotonic() >= deadline:
                break
        raise StoreError(
            f"the mooncake_client storage node ({self.segment_bytes} B segment) did not start: "
            f"{self._tail('node')}"
        )

    def kill_node(self) -> None:
        """SIGKILL the storage node (a lost node); its pages are gone."""
        _stop(self._node, signal.SIGKILL)

    def kill_master(self) -> None:
        """SIGKILL the master (a dead master)."""
        _stop(self._master, signal.SIGKILL)

    def close(self) -> None:
        """Stop the node and the master by pid (SIGTERM, then SIGKILL). Idempotent."""
        try:
            _stop(self._node)
        finally:
            _stop(self._master)

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            return subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.log_dir,  # glog writes nowhere else
                start_new_session=True,  # a terminal's ^C does not reach it; we stop it by pid
                preexec_fn=_die_with_parent(),  # but it does not outlive this process
            )
        except OSError as e:
            raise StoreError(f"cannot start {argv[0]}: {e.strerror}") from e
        finally:
            log.close()

    def _tail(self, name: str, lines: int = 5) -> str:
        try:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        return " | ".join(text.splitlines()[-lines:]) or "(empty log)"


@contextlib.contextmanager
def local_mooncake(
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    log_dir: str | Path | None = None,
    timeout_s: float = START_TIMEOUT_S,
    node: bool = True,
    lease_ttl_ms: int | None = None,
    client_ttl_s: int | None = None,
) -> Iterator[LocalMooncake]:
    """A master and a storage node of ``segment_bytes`` on free 127.0.0.1 ports; stopped on exit.

    Logs go to ``log_dir`` (a temporary folder, removed afterwards, when None). ``node=False``
    starts the master alone (no segment until start_node()). ``lease_ttl_ms`` and
    ``client_ttl_s`` are the master's --default_kv_lease_ttl and --client_ttl.
    """
    if (
        isinstance(segment_bytes, bool)
        or not isinstance(segment_bytes, int)
        or segment_bytes < (1 << 20)
    ):
        raise ConfigError(f"segment_bytes {segment_bytes!r}: expected an int of at least 1 MiB")
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="hicache-mc-")))
        else:
            folder = Path(log_dir)
            folder.mkdir(parents=True, exist_ok=True)
        cluster = LocalMooncake(
            folder, segment_bytes, lease_ttl_ms=lease_ttl_ms, client_ttl_s=client_ttl_s
        )
        stack.callback(cluster.close)
        if node:
            cluster.start(timeout_s)
        else:
            cluster.start_master(timeout_s)
        yield cluster


@contextlib.contextmanager
def mooncake_store(
    extra_config: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    provide_host_memory: bool = True,
) -> Iterator[tuple[MooncakeStore, LocalMooncake | None]]:
    """(store, the local cluster started for it or None); both closed on exit.

    When the extra config, MOONCAKE_CONFIG_PATH or MOONCAKE_MASTER names a master, the store
    connects to it; otherwise a local master and a storage node of ``segment_bytes`` are started
    and the store's other settings come from ``extra_config``.
    """
    with contextlib.ExitStack() as stack:
        cluster: LocalMooncake | None = None
        if names_master(extra_config, environ):
            config = load_mooncake_config(extra_config, environ)
        else:
            cluster = stack.enter_context(local_mooncake(segment_bytes=segment_bytes))
            config = load_mooncake_config(cluster.extra_config(**dict(extra_config or {})), {})
        store = MooncakeStore.open(config, provide_host_memory=provide_host_memory)
        stack.callback(store.close)
        yield store, cluster


class _ClusterStore(DelegatingStore):
    """A MooncakeStore that owns the exit stack of what was started for it."""

    def __init__(self, store: MooncakeStore, stack: contextlib.ExitStack, cluster: object) -> None:
        super().__init__(store)
        self._stack = stack
        self.cluster = cluster

    def close(self) -> None:
        """Close the store, then stop the processes started for it; idempotent."""
        self._stack.close()


def open_mooncake_or_local(
    extra_config: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    provide_host_memory: bool = True,
) -> Store:
    """A Mooncake store on the named cluster, or on a local one that its close() stops
    (``provide_host_memory``: as MooncakeStore.open)."""
    stack = contextlib.ExitStack()
    try:
        store, cluster = stack.enter_context(
            mooncake_store(
                extra_config,
                environ,
                segment_bytes=segment_bytes,
                provide_host_memory=provide_host_memory,
            )
        )
    except BaseException:
        stack.close()
        raise
    return _ClusterStore(store, stack, cluster)
