"""Page keys with per-block extras (hicache.integrations.vllm.block_keys), without vLLM."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.domain.errors import ConfigError
from hicache.domain.keys import chain_keys, pack_tokens
from hicache.integrations.vllm.block_keys import (
    NO_PRIOR,
    UnkeyableError,
    chain_block_keys,
    encode_extras,
    extras_digest,
)

BS = 4
TOKENS = list(range(1, 4 * 40 + 3))  # 40 full blocks and 2 tokens
N = len(TOKENS) // BS
SALT = extras_digest((("cache_salt", "tenant-a"),))
LORA = extras_digest((("lora", "adapter-a", "/adapters/a"),))
ROOT = Path(__file__).resolve().parents[3]


def reference(
    tokens: list[int], digests: list[bytes | None], prior: bytes | None = None
) -> list[bytes]:
    """The chain written out block by block with hashlib (the formula the module documents)."""
    keys = []
    for b, d in enumerate(digests):
        page = pack_tokens(tokens[b * BS : (b + 1) * BS])
        msg = (prior or b"") + page if d is None else (prior or NO_PRIOR) + page + d
        prior = hashlib.sha256(msg).digest()
        keys.append(prior)
    return keys


def test_blocks_without_extras_have_the_plain_token_chain_keys() -> None:
    assert chain_block_keys(TOKENS, BS, [None] * N) == chain_keys(TOKENS, BS)
    prior = hashlib.sha256(b"p").digest()
    assert chain_block_keys(TOKENS, BS, [None] * N, prior=prior) == chain_keys(
        TOKENS, BS, prior=prior
    )


@pytest.mark.parametrize(
    "digests",
    [
        [SALT] + [None] * (N - 1),  # cache_salt: the first block only
        [LORA] * N,  # LoRA: every block (a run long enough for the C chain)
        [None] * 5 + [LORA] * 3 + [None] * (N - 8),  # an image in blocks 5-7
        [SALT, None, LORA, LORA, None] + [LORA] * (N - 5),
    ],
)
def test_keys_follow_the_documented_formula(digests: list[bytes | None]) -> None:
    assert chain_block_keys(TOKENS, BS, digests) == reference(TOKENS, digests)
    prior = hashlib.sha256(b"p").digest()
    assert chain_block_keys(TOKENS, BS, digests, prior=prior) == reference(TOKENS, digests, prior)


def test_extras_of_one_block_change_its_key_and_every_later_key_only() -> None:
    plain = chain_block_keys(TOKENS, BS, [None] * N)
    image = chain_block_keys(TOKENS, BS, [None] * 5 + [LORA] + [None] * (N - 6))
    assert image[:5] == plain[:5]
    assert all(a != b for a, b in zip(image[5:], plain[5:], strict=True))


def test_a_salt_on_the_first_block_separates_the_whole_chain() -> None:
    plain = chain_block_keys(TOKENS, BS, [None] * N)
    a = chain_block_keys(TOKENS, BS, [SALT] + [None] * (N - 1))
    b = chain_block_keys(TOKENS, BS, [extras_digest((("cache_salt", "b"),))] + [None] * (N - 1))
    assert not set(a) & set(plain)
    assert not set(a) & set(b)


def test_a_key_continued_from_a_prior_equals_the_whole_chain() -> None:
    digests = [SALT, None, None, LORA] + [None] * (N - 4)
    whole = chain_block_keys(TOKENS, BS, digests)
    head = chain_block_keys(TOKENS[: 7 * BS], BS, digests[:7])
    tail = chain_block_keys(TOKENS[7 * BS :], BS, digests[7:], prior=head[-1])
    assert head + tail == whole


def test_a_plain_message_never_matches_an_extras_message_of_the_same_bytes() -> None:
    # A plain second block hashes prior(32) || tokens; a first block with extras hashes
    # NO_PRIOR || tokens || digest: even tokens chosen to spell out those bytes give
    # a message of another length, so another key.
    digest = LORA
    first = chain_block_keys(TOKENS[:BS], BS, [digest])[0]
    words = list(memoryview(NO_PRIOR).cast("I"))
    forged = chain_keys(words + TOKENS[:BS], len(words) + BS)  # NO_PRIOR || tokens as ids
    assert forged[0] != first


def test_extras_encoding_is_pinned() -> None:
    # Stored pages are named by these bytes: an encoding change is a new version, never silent.
    extras = (
        ("lora", "a", "/p"),
        ("mm", "img-1", -3),
        ("cache_salt", "s"),
        ("prompt_embeds", b"\x01" * 32),
    )
    assert encode_extras(extras).startswith(b"hicache.vllm.extra-keys.v1\x00")
    assert extras_digest(extras) == hashlib.sha256(encode_extras(extras)).digest()
    assert extras_digest(extras).hex() == (
        "76a5797cd6fac0090700e8f9f8073b2b580d63a8f0092415e797dd4a0bc95d04"
    )


def test_extras_digests_are_the_same_in_another_process_and_hash_seed() -> None:
    code = (
        "from hicache.integrations.vllm.block_keys import chain_block_keys, extras_digest;"
        "d = extras_digest((('lora', 'a', '/p'), ('mm', 'img', 2), ('cache_salt', 's')));"
        "print(chain_block_keys(list(range(64)), 4, [d] + [None] * 15)[-1].hex())"
    )
    out = set()
    for seed in ("0", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT / "src")}
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        out.add(proc.stdout.strip())
    assert len(out) == 1


@pytest.mark.parametrize(
    ("extras", "names"),
    [
        ((("future_kind", 1),), "future_kind"),
        ((("mm", None, 0),), "None"),  # an item without an identifier
        ((("mm", "img", True),), "True"),  # bool is not an offset
        ((("mm", "img", 1.0),), "1.0"),
        ((("mm", "img", 2**63),), "out of the signed 64-bit range"),
        ((("lora", "a"),), "2 fields, got 1"),
        ((("cache_salt", "\ud800"),), "UTF-8"),
        ((("prompt_embeds", "not bytes"),), "bytes was expected"),
        (("cache_salt",), "expected a tuple"),
        ((("lora", "a", "/p"), ()), "expected a tuple"),
        ({"lora": "a"}, "expected a tuple of elements"),
    ],
)
def test_an_extra_key_hicache_cannot_encode_is_an_unkeyable_error_naming_it(
    extras: object, names: str
) -> None:
    with pytest.raises(UnkeyableError, match=names.replace("(", r"\(").replace(".", r"\.")):
        extras_digest(extras)  # type: ignore[arg-type]


def test_digests_must_cover_every_full_block() -> None:
    with pytest.raises(ConfigError, match="3 digests for 40 full blocks"):
        chain_block_keys(TOKENS, BS, [None] * 3)
    with pytest.raises(ConfigError, match="expected 32 bytes"):
        chain_block_keys(TOKENS, BS, [b"short"] + [None] * (N - 1))
