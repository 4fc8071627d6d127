"""Page keys: known-answer vectors, SGLang's chain followed by hand, full pages only, bad ids."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.domain import ConfigError
from hicache.domain.keys import chain_keys, key_of_hex, pack_tokens, page_hex, page_key

# Frozen vectors: SGLang's get_hash_str(token_ids, prior_hash) (hicache_storage.py at sgl-project
# /sglang@bb424de) worked by hand: sha256 over bytes.fromhex(prior) then t.to_bytes(4, "little").
SHA_OF_FOUR_ZERO_BYTES = "df3f619804a92fdb4057192dc43dd748ea778adc52bc498ce80524c014b81119"
PAGE_1234 = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72"
PAGE_5678_AFTER_1234 = "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6"
EXTREMES = "65c11b62323b522ddad7138ecf9d6a4394809d1832e4d330ab4ceae386975cc4"


def sglang_get_hash_str(token_ids: list[int], prior_hash: str | None = None) -> str:
    """SGLang's loop, one token at a time, as its source does it (the reference)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for t in token_ids:
        hasher.update(t.to_bytes(4, byteorder="little", signed=False))
    return hasher.hexdigest()


def test_first_page_is_sha256_of_little_endian_uint32_ids() -> None:
    assert page_hex(chain_keys([0], 1)[0]) == SHA_OF_FOUR_ZERO_BYTES
    hand = bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0])
    assert chain_keys([1, 2, 3, 4], 4)[0] == hashlib.sha256(hand).digest()
    assert page_hex(chain_keys([1, 2, 3, 4], 4)[0]) == PAGE_1234


def test_next_page_hashes_the_prior_digest_bytes_not_its_hex_text() -> None:
    first, second = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4)
    by_hand = hashlib.sha256(first + struct.pack("<4I", 5, 6, 7, 8)).digest()
    assert second == by_hand
    assert page_hex(second) == PAGE_5678_AFTER_1234
    hex_text_variant = hashlib.sha256(first.hex().encode() + struct.pack("<4I", 5, 6, 7, 8))
    assert second != hex_text_variant.digest()


def test_extreme_token_ids_pack_as_unsigned_32_bit() -> None:
    assert page_hex(page_key([151643, 2**32 - 1])) == EXTREMES
    assert pack_tokens([2**32 - 1, 1]) == b"\xff\xff\xff\xff\x01\x00\x00\x00"


def test_frozen_vectors_match_sglangs_code_followed_by_hand() -> None:
    assert sglang_get_hash_str([0]) == SHA_OF_FOUR_ZERO_BYTES
    assert sglang_get_hash_str([1, 2, 3, 4]) == PAGE_1234
    assert sglang_get_hash_str([5, 6, 7, 8], PAGE_1234) == PAGE_5678_AFTER_1234


@given(
    st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80),
    st.integers(min_value=1, max_value=9),
)
def test_chain_equals_sglang_chain_for_any_ids_and_page_size(ids: list[int], page: int) -> None:
    expected: list[str] = []
    prior: str | None = None
    for start in range(0, len(ids) // page * page, page):
        prior = sglang_get_hash_str(ids[start : start + page], prior)
        expected.append(prior)
    assert [page_hex(k) for k in chain_keys(ids, page)] == expected


def test_only_full_pages_get_keys_and_a_chain_continues_after_a_prior() -> None:
    ids = list(range(10))
    keys = chain_keys(ids, 4)
    assert len(keys) == 2  # the last 2 tokens are a partial page
    assert chain_keys(ids[4:], 4, prior=keys[0]) == keys[1:]
    assert chain_keys(pack_tokens(ids), 4) == keys
    assert chain_keys([], 4) == []


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7"])
def test_a_token_id_out_of_uint32_range_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"token id"):
        chain_keys([1, bad, 2], 1)  # type: ignore[list-item]


def test_bad_page_size_prior_and_hex_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="page_size"):
        chain_keys([1], 0)
    with pytest.raises(ConfigError, match="prior key"):
        chain_keys([1], 1, prior=b"short")
    with pytest.raises(ConfigError, match="multiple of 4"):
        chain_keys(b"\x00\x01\x02", 1)
    with pytest.raises(ConfigError, match="64 hex digits"):
        key_of_hex("abc")
    assert key_of_hex(PAGE_1234).hex() == PAGE_1234
