"""KeyChain: the keys of chain_keys held as one bytes object, read as a sequence of keys."""

from __future__ import annotations

import random

import pytest

from hicache.domain import ConfigError, KeyChain, chain_keys, key_chain
from hicache.domain.keys import KEY_BYTES


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200_000) for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("tokens", [0, 5, 31 * 16, 40 * 16 + 7])
def test_a_key_chain_holds_exactly_the_keys_of_chain_keys(page_size: int, tokens: int) -> None:
    ids = prompt(tokens, tokens)
    for prior in (None, b"\x07" * KEY_BYTES):
        want = chain_keys(ids, page_size, prior=prior)
        got = key_chain(ids, page_size, prior=prior)
        assert len(got) == len(want)
        assert list(got) == want
        assert [got[i] for i in range(len(got))] == want
        assert [got[-i - 1] for i in range(len(got))] == want[::-1]
        assert list(reversed(got)) == want[::-1]
        assert got == want
        assert want == got
        assert got == tuple(want)
        assert hash(got) == hash(tuple(want))
        assert got.blob == b"".join(want)
        assert got.prior == prior


def test_a_slice_shares_the_keys_and_names_the_key_before_it_as_prior() -> None:
    want = chain_keys(prompt(100), 4)
    chain = key_chain(prompt(100), 4)
    part = chain[5:12]
    assert isinstance(part, KeyChain)
    assert list(part) == want[5:12]
    assert part.prior == want[4]
    assert chain[:3].prior is None
    assert part[2:4].prior == want[6]
    assert list(chain[30:10]) == []
    assert len(chain[-3:]) == 3
    assert part.starts_with(want[5:8])
    assert not part.starts_with(want[6:9])
    assert not part.starts_with(want[5:20])  # longer than the chain
    assert chain[:4] + want[4:6] == want[:6]
    assert want[:2] + chain[2:4] == want[:4]
    assert chain[:2] + chain[2:3] == want[:3]


def test_bad_blobs_priors_indexes_and_steps_are_config_errors_naming_them() -> None:
    with pytest.raises(ConfigError, match="33 bytes"):
        KeyChain(b"\x00" * 33)
    with pytest.raises(ConfigError, match="got str"):
        KeyChain("00" * 32)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="prior key"):
        KeyChain(b"\x00" * 64, prior=b"\x01" * 31)
    chain = KeyChain(b"\x00" * 64)
    with pytest.raises(IndexError, match="index 2 out of range for 2 keys"):
        chain[2]
    with pytest.raises(ConfigError, match="step 2"):
        chain[::2]
    with pytest.raises(ConfigError, match="'a'"):
        chain["a"]  # type: ignore[call-overload]


def test_starts_with_compares_every_key_of_a_long_chain() -> None:
    want = chain_keys(prompt(5000, 1), 1)
    chain = key_chain(prompt(5000, 1), 1)
    assert chain.starts_with(want)
    assert chain.starts_with(want[:4097])
    for bad in (0, 2047, 2048, 4999):  # first and last of a piece, and the very last key
        keys = list(want)
        keys[bad] = bytes(KEY_BYTES)
        assert not chain.starts_with(keys)
