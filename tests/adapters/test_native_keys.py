"""The native page-key chain gives exactly the Python chain's keys (SHA-NI and portable paths),
and a chain hasher that differs is refused before it is used."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from hicache.adapters.native_keys import NativeKeys, install_native_keys, load_native_keys
from hicache.domain import ConfigError
from hicache.domain import keys as K
from hicache.domain.keys import (
    chain_hasher,
    chain_keys,
    key_chain,
    pack_tokens,
    set_chain_hasher,
)


@pytest.fixture
def native() -> Iterator[NativeKeys]:
    try:
        lib = load_native_keys()
    except Exception as e:  # no C compiler here: nothing native to check
        pytest.skip(f"native key helper unavailable: {e}")
    before = chain_hasher()
    yield lib
    if before == "python":
        set_chain_hasher(None)


@pytest.mark.parametrize("portable", [False, True])
def test_native_chain_equals_the_python_chain_on_random_prompts(
    native: NativeKeys, portable: bool
) -> None:
    rng = random.Random(11)
    for page_size in (1, 2, 7, 13, 14, 15, 16, 17, 64, 100):
        tokens = [rng.randrange(2**32) for _ in range(rng.randrange(page_size, 40 * page_size))]
        packed = pack_tokens(tokens)
        step = page_size * 4
        for prior in (None, bytes(rng.randrange(256) for _ in range(32))):
            want = K._python_chain(packed, step, prior)
            assert native.chain(packed, step, prior, portable=portable) == want


def test_chain_keys_give_the_same_keys_with_the_native_chain_installed(native: NativeKeys) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(200_000) for _ in range(n)] for n in (0, 1, 31, 33, 1000, 5003)]
    set_chain_hasher(None)
    want = [
        (chain_keys(p, ps), chain_keys(p, ps, prior=b"\x01" * 32))
        for p in prompts
        for ps in (1, 16)
    ]
    installed, name = install_native_keys()
    assert installed
    assert name.startswith("native")
    assert chain_hasher() == name
    got = [
        (chain_keys(p, ps), chain_keys(p, ps, prior=b"\x01" * 32))
        for p in prompts
        for ps in (1, 16)
    ]
    assert got == want


def test_a_chain_hasher_whose_keys_differ_is_refused_and_not_used() -> None:
    set_chain_hasher(None)

    def off_at_page_16(packed: bytes, step: int, prior: bytes | None) -> list[bytes]:
        keys = K._python_chain(packed, step, prior)
        if step == 64 and keys:
            keys[-1] = bytes([keys[-1][0] ^ 1]) + keys[-1][1:]
        return keys

    with pytest.raises(ConfigError, match=r"'flipped'.*page size 16"):
        set_chain_hasher(off_at_page_16, name="flipped")
    assert chain_hasher() == "python"

    def broken(packed: bytes, step: int, prior: bytes | None) -> list[bytes]:
        raise RuntimeError("boom")

    with pytest.raises(ConfigError, match="'broken'"):
        set_chain_hasher(broken, name="broken")
    assert chain_hasher() == "python"


def test_key_chain_holds_the_same_keys_with_the_native_chain_installed(native: NativeKeys) -> None:
    rng = random.Random(9)
    prompts = [[rng.randrange(200_000) for _ in range(n)] for n in (0, 31, 33, 2000)]
    set_chain_hasher(None)
    want = [
        chain_keys(p, ps, prior=pr)
        for p in prompts
        for ps in (1, 16)
        for pr in (None, b"\x02" * 32)
    ]
    installed, _ = install_native_keys()
    assert installed
    got = [
        key_chain(p, ps, prior=pr) for p in prompts for ps in (1, 16) for pr in (None, b"\x02" * 32)
    ]
    assert got == want
    assert [g.blob for g in got] == [b"".join(w) for w in want]


def test_a_chain_hasher_whose_joined_keys_differ_is_refused_and_not_used() -> None:
    set_chain_hasher(None)

    class Hasher:
        def __call__(self, packed: bytes, step: int, prior: bytes | None) -> list[bytes]:
            return K._python_chain(packed, step, prior)

        def blob(self, packed: bytes, step: int, prior: bytes | None) -> bytes:
            joined = b"".join(K._python_chain(packed, step, prior))
            return joined[:-1] + bytes([joined[-1] ^ 1]) if joined else joined

    with pytest.raises(ConfigError, match=r"'joined'.*joined keys differ"):
        set_chain_hasher(Hasher(), name="joined")
    assert chain_hasher() == "python"
