"""The arguments of SGLang's HiCacheStorage calls, checked: each returns the value in the form
the backend uses or raises ConfigError naming the call, the value and what was expected.

- one_key / page_keys: a key; a call's keys (a list or tuple of str).
- host_tokens: the host token index each page of a v1 / v2 call starts at.
- flat_pages: the flat page tensors of a legacy call as store buffers.
- transfers_of: a v2 call's per-pool transfers (a list of SGLang's PoolTransfer).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from hicache.domain.errors import ConfigError, shown
from hicache.domain.storage import PageBuffer
from hicache.integrations.sglang.pages import tensor_bytes


def one_key(key: object, call: str) -> str:
    if not isinstance(key, str):
        raise ConfigError(
            f"HiCacheBackend {call}: key {shown(key)} ({type(key).__name__}): expected a str"
        )
    return key


def page_keys(keys: object, call: str) -> list[str]:
    """SGLang's page keys of one call: a list (or tuple) of str, else ConfigError (a str is
    one key, not a list of its characters; a generator cannot be counted against indices)."""
    if not isinstance(keys, list | tuple):
        raise ConfigError(
            f"HiCacheBackend {call}: keys must be a list of str, got {type(keys).__name__}"
            + (f" {shown(keys)}" if isinstance(keys, str | bytes) else "")
        )
    for i, key in enumerate(keys):
        if not isinstance(key, str):
            raise ConfigError(
                f"HiCacheBackend {call}: keys[{i}] is {shown(key)} ({type(key).__name__}): "
                "expected a str"
            )
    return list(keys)


def host_tokens(host_indices: object, n: int, page_size: int, pool: str, call: str) -> list[int]:
    """The host token index each of ``n`` pages starts at; ConfigError unless
    ``host_indices`` is an integer CPU tensor of ``n * page_size`` indices."""
    if not isinstance(host_indices, torch.Tensor):
        raise ConfigError(
            f"HiCacheBackend {call}: host_indices must be a torch.Tensor of token indices, "
            f"got {type(host_indices).__name__}"
        )
    if host_indices.device.type != "cpu":
        raise ConfigError(
            f"HiCacheBackend {call}: host_indices on device {host_indices.device}: expected "
            "cpu (host pool indices)"
        )
    dtype = host_indices.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ConfigError(
            f"HiCacheBackend {call}: host_indices of dtype {dtype}: expected an integer dtype"
        )
    ps = page_size
    if int(host_indices.numel()) != n * ps:
        raise ConfigError(
            f"HiCacheBackend pool {shown(pool)}: host_indices has {int(host_indices.numel())} "
            f"token indices for {n} keys: expected {n * ps} (page size {ps})"
        )
    # Page i starts at token index i * ps: read those n starts only (a strided view).
    return [int(t) for t in host_indices.reshape(-1)[::ps].tolist()]


def flat_pages(tensors: object, n: int, page_bytes: int, pool: str, what: str) -> list[PageBuffer]:
    """``n`` flat pages of ``pool`` (``page_bytes`` each) as buffers; ConfigError unless ``tensors`` is a list of
    ``n`` contiguous CPU tensors of one flat page each."""
    if not isinstance(tensors, list | tuple):
        raise ConfigError(
            f"HiCacheBackend {what}: expected a list of {n} flat page tensors, got "
            f"{type(tensors).__name__}"
        )
    if len(tensors) != n:
        raise ConfigError(f"HiCacheBackend: {n} keys and {len(tensors)} {what}")
    out: list[PageBuffer] = []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise ConfigError(
                f"HiCacheBackend {what}[{i}] is {type(t).__name__}: expected a writable "
                "flat page tensor (e.g. get_dummy_flat_data_page())"
            )
        view = tensor_bytes(t)
        if view.nbytes != page_bytes:
            raise ConfigError(
                f"HiCacheBackend {what}[{i}] has {view.nbytes} bytes: expected a flat page "
                f"of pool {shown(pool)}, {page_bytes} bytes"
            )
        out.append([view])
    return out


T = TypeVar("T")


def transfers_of(value: Any, kind: type[T], call: str) -> list[T]:
    """A v2 call's transfers: a list (or tuple) of ``kind`` (SGLang's PoolTransfer)."""
    if not isinstance(value, list | tuple) or not all(isinstance(t, kind) for t in value):
        raise ConfigError(
            f"HiCacheBackend {call}: expected a list of SGLang's {kind.__name__}, got "
            f"{type(value).__name__} {shown(value)}"
        )
    return list(value)
