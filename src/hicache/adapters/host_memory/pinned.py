"""Page-locked (pinned) host memory for CUDA and ROCm, wrapping any host region.

- PinnedRegion: a region of any kind (anonymous, shm, store) registered with the GPU driver;
  PinnedRegion.wrap(region, row_bytes=...) pins it, close() unpins and closes the region.
- HostRegistrar: the port to the driver (register a range, unregister it, name an error code).
- TorchCudaRegistrar: cudaHostRegister / cudaHostUnregister through torch.cuda.cudart(); torch
  maps these to hipHostRegister / hipHostUnregister on ROCm builds.
- plan_chunks: the (offset, size) chunks a registration is split into.
- gpu_available / require_gpu: the up-front GPU check (never inferred from torch's errors).

Rules: registration is done in chunks of at most MAX_CHUNK_BYTES (one call of 512 GiB or more
fails on some drivers), every chunk boundary falls on a whole page row (a batched copy may not
span two registrations) and on a whole 4 KiB page; every chunk's return code is checked, and a
failure unregisters the chunks already registered and raises PinnedMemoryError. There is no
fallback to pageable memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from hicache.adapters.host_memory.base import HostRegion, check_nbytes
from hicache.domain import ConfigError, HostMemoryError, PinnedMemoryError

MAX_CHUNK_BYTES = 64 << 30
CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable / hipHostRegisterPortable
PAGE_BYTES = mmap.PAGESIZE


def gpu_available() -> bool:
    """Whether a CUDA or ROCm GPU is usable by torch in this process."""
    return bool(torch.cuda.is_available())


def require_gpu(what: str = "pinned host memory") -> None:
    """Raise PinnedMemoryError unless a CUDA or ROCm GPU is present."""
    if not gpu_available():
        raise PinnedMemoryError(
            f"{what} was asked for (pinned=on) but no CUDA or ROCm GPU is available "
            "(torch.cuda.is_available() is False); page-locking needs the GPU driver. "
            "Use pinned=auto to pin only where a GPU exists, or pinned=off"
        )


class HostRegistrar(Protocol):
    """Registers host ranges with a GPU driver. Return codes: 0 is success."""

    def register(self, address: int, nbytes: int) -> int: ...

    def unregister(self, address: int) -> int: ...

    def error_string(self, code: int) -> str: ...


class TorchCudaRegistrar:
    """cudaHostRegister(ptr, size, cudaHostRegisterPortable) through torch.cuda.cudart()."""

    def __init__(self, device: int | None = None, flags: int = CUDA_HOST_REGISTER_PORTABLE) -> None:
        require_gpu()
        if device is not None and not 0 <= device < torch.cuda.device_count():
            raise ConfigError(
                f"GPU index {device} is out of range: this machine has "
                f"{torch.cuda.device_count()} GPU(s) visible to torch"
            )
        # torch.cuda.cudart() is untyped in torch: the module binds libcudart (libamdhip64 on ROCm)
        self._cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self._device = device
        self._flags = flags
        self._clear_last_error = _LastErrorReset()

    def register(self, address: int, nbytes: int) -> int:
        with _on_device(self._device):
            code = int(self._cudart.cudaHostRegister(address, nbytes, self._flags))
            if code != 0:
                self._clear_last_error()
        return code

    def unregister(self, address: int) -> int:
        with _on_device(self._device):
            code = int(self._cudart.cudaHostUnregister(address))
            if code != 0:
                self._clear_last_error()
        return code

    def error_string(self, code: int) -> str:
        try:
            return str(self._cudart.cudaGetErrorString(self._cudart.cudaError(code)))
        except Exception:  # only formats a message for a failure already detected by its code
            return "unknown CUDA/HIP error"


def _on_device(device: int | None) -> contextlib.AbstractContextManager[object]:
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


class _LastErrorReset:
    """cudaGetLastError() (hipGetLastError() on ROCm) of the runtime torch has loaded.

    A failed cudaHostRegister leaves its error in the runtime's per-thread "last error", where
    torch's next kernel-launch check would find it and fail an unrelated operation. torch binds
    no cudaGetLastError, so it is called through ctypes on the library already mapped into this
    process (the same runtime instance). Where the runtime is linked statically into torch there
    is no such library and this does nothing.
    """

    def __init__(self) -> None:
        hip = torch.version.hip is not None
        prefix, symbol = (
            ("libamdhip64.so", "hipGetLastError") if hip else ("libcudart.so", "cudaGetLastError")
        )
        self._func: Any = None
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5]).startswith(prefix):
                try:
                    func = getattr(ctypes.CDLL(fields[5]), symbol)
                except (OSError, AttributeError):
                    return
                func.restype = ctypes.c_int
                func.argtypes = []
                self._func = func
                return

    def __call__(self) -> None:
        if self._func is not None:
            self._func()


def plan_chunks(
    nbytes: int, *, row_bytes: int = 1, chunk_bytes: int = MAX_CHUNK_BYTES
) -> list[tuple[int, int]]:
    """Split ``nbytes`` into (offset, size) chunks of at most ``chunk_bytes``.

    Every boundary between two chunks is a multiple of ``row_bytes`` and of the 4 KiB page, so
    no page row and no page straddles two registrations. Only the last chunk may be shorter.
    A region that fits one chunk is one chunk, whatever its row size.
    """
    check_nbytes(nbytes)
    check_nbytes(row_bytes, "row_bytes (the bytes of one page row, the registration alignment)")
    check_nbytes(chunk_bytes, "chunk_bytes (the largest single registration)")
    if nbytes <= chunk_bytes:
        return [(0, nbytes)]  # one registration: no boundary to align
    align = math.lcm(row_bytes, PAGE_BYTES)
    step = chunk_bytes // align * align
    if step == 0:
        raise ConfigError(
            f"cannot register host memory in chunks of at most {chunk_bytes} B aligned to "
            f"{align} B (row_bytes={row_bytes} with {PAGE_BYTES} B pages): "
            f"expected chunk_bytes >= {align}"
        )
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


class HostRegistration:
    """The chunks of one registered host range; release() unregisters them (idempotent)."""

    def __init__(
        self, registrar: HostRegistrar, address: int, chunks: list[tuple[int, int]]
    ) -> None:
        self._registrar = registrar
        self.address = address
        self.chunks = tuple(chunks)
        self._active = True

    @classmethod
    def register(
        cls,
        registrar: HostRegistrar,
        address: int,
        nbytes: int,
        *,
        row_bytes: int = 1,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        what: str = "host region",
    ) -> HostRegistration:
        """Register every chunk or none: on a failed chunk, undo the others and raise."""
        chunks = plan_chunks(nbytes, row_bytes=row_bytes, chunk_bytes=chunk_bytes)
        done: list[tuple[int, int]] = []
        try:
            for index, (offset, size) in enumerate(chunks):
                code = registrar.register(address + offset, size)
                if code != 0:
                    undone = _unregister_all(registrar, address, done)
                    done = []
                    rollback = (
                        f"the {index} chunk(s) before it were unregistered"
                        if not undone
                        else f"unregistering the chunks before it also failed: {undone}"
                    )
                    raise PinnedMemoryError(
                        f"cudaHostRegister failed for chunk {index} of {len(chunks)} "
                        f"(offset {offset}, {size} B at 0x{address + offset:x}) of a {nbytes} B "
                        f"{what}: {_describe(registrar, code)}; {rollback}; "
                        "the memory is not pinned"
                    )
                done.append((offset, size))
        except BaseException:
            _unregister_all(registrar, address, done)
            raise
        return cls(registrar, address, chunks)

    @property
    def active(self) -> bool:
        return self._active

    def release(self) -> None:
        """Unregister every chunk; raise PinnedMemoryError naming those that failed."""
        if not self._active:
            return
        self._active = False
        failures = _unregister_all(self._registrar, self.address, list(self.chunks))
        if failures:
            raise PinnedMemoryError(f"cudaHostUnregister failed: {failures}")


def _unregister_all(registrar: HostRegistrar, address: int, chunks: list[tuple[int, int]]) -> str:
    """Unregister ``chunks`` (last first), going on past failures; describe the failures."""
    failures = []
    for offset, size in reversed(chunks):
        code = registrar.unregister(address + offset)
        if code != 0:
            failures.append(
                f"chunk at offset {offset} ({size} B at 0x{address + offset:x}): "
                f"{_describe(registrar, code)}"
            )
    return "; ".join(failures)


def _describe(registrar: HostRegistrar, code: int) -> str:
    return f"{registrar.error_string(code)} (error {code})"


class PinnedRegion(HostRegion):
    """Any host region, page-locked; owns the wrapped region and closes it on close()."""

    def __init__(self, inner: HostRegion, registration: HostRegistration, row_bytes: int) -> None:
        # Use PinnedRegion.wrap; this only takes ownership of an already registered region.
        self.kind = inner.kind
        self.nbytes = inner.nbytes
        self.row_bytes = row_bytes
        self._inner: HostRegion | None = inner
        self._registration = registration

    @classmethod
    def wrap(
        cls,
        region: HostRegion,
        *,
        row_bytes: int = 1,
        chunk_bytes: int = MAX_CHUNK_BYTES,
        device: int | None = None,
        registrar: HostRegistrar | None = None,
    ) -> PinnedRegion:
        """Page-lock ``region`` and take ownership of it.

        On failure nothing stays registered and ``region`` is left open and owned by the caller.
        Without a GPU (and no explicit ``registrar``) this raises PinnedMemoryError up front.
        """
        if region.closed:
            raise HostMemoryError(f"cannot pin a closed host region: {region!r}")
        if region.pinned:
            raise PinnedMemoryError(f"host region is already pinned: {region!r}")
        if registrar is None:
            registrar = TorchCudaRegistrar(device)
        registration = HostRegistration.register(
            registrar,
            region.address,
            region.nbytes,
            row_bytes=row_bytes,
            chunk_bytes=chunk_bytes,
            what=f"{region.kind} host region",
        )
        return cls(region, registration, row_bytes)

    @property
    def inner(self) -> HostRegion:
        """The wrapped (anonymous, shm or store) region."""
        if self._inner is None:
            raise HostMemoryError("pinned host region is closed")
        return self._inner

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The registered (offset, size) chunks."""
        return self._registration.chunks

    @property
    def address(self) -> int:
        return self.inner.address

    @property
    def pinned(self) -> bool:
        return self._inner is not None and self._registration.active

    @property
    def shm_name(self) -> str | None:
        return self.inner.shm_name

    def tensor(self) -> torch.Tensor:
        return self.inner.tensor()

    @property
    def closed(self) -> bool:
        return self._inner is None

    def unwrap(self) -> HostRegion:
        """Unpin and hand the wrapped region back to the caller (this wrapper is then closed)."""
        inner = self.inner
        self._registration.release()  # on failure the wrapper stays open: close() still cleans up
        self._inner = None
        return inner

    def close(self) -> None:
        """Unpin, then close the wrapped region, even if unpinning failed. Idempotent."""
        if self._inner is None:
            return
        inner, self._inner = self._inner, None
        try:
            self._registration.release()
        finally:
            inner.close()

    def __repr__(self) -> str:
        if self._inner is None:
            return f"<PinnedRegion {self.kind} {self.nbytes} B closed>"
        return f"<PinnedRegion {len(self.chunks)} chunk(s) of {self._inner!r}>"
