"""vLLM Requests keyed with their extras (LoRA, multimodal items, cache_salt, prompt embeddings)
through the scheduler side, in-process (vLLM's Request objects, no LLM)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import structlog

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from hicache.domain.keys import chain_keys  # noqa: E402
from hicache.integrations.vllm.plan import Event, Op  # noqa: E402
from hicache.integrations.vllm.request_keys import (  # noqa: E402
    RequestExtras,
    has_extras,
    prompt_tokens,
    request_extras,
)
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide  # noqa: E402
from hicache.integrations.vllm.stats import ConnectorStats  # noqa: E402

BS = 4
PROMPT = [(i * 37) % 1000 + 1 for i in range(41)]  # 10 full blocks and 1 token
HIT = 40


def request(rid: str, tokens: list[int] | None = PROMPT, **kw: Any) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, **kw)


def image(identifier: str | None, offset: int, length: int = 6) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,  # type: ignore[arg-type]
        mm_position=PlaceholderRange(offset=offset, length=length),
    )


def side() -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=64,
        store=None,
        store_keys=lambda _k: [],
        write_storage=False,
        save_decode=False,
        ranks=1,
        stats=ConnectorStats(),
    )


def keys(req: Request) -> list[bytes]:
    """The page keys the scheduler side gives the request's full prompt blocks."""
    s = side()
    s.match(req.request_id, prompt_tokens(req), 0, request_extras(req, BS))
    tokens = prompt_tokens(req)
    plan = s.build(
        [Scheduled(req.request_id, req.all_token_ids, 0, len(tokens))],
        lambda _r: list(range(100)),
    )
    return [op.key for op in plan.saves]


def save(s: SchedulerSide, req: Request) -> int:
    """Match, then prefill and report every save; returns the tokens the match hit."""
    hit, _ = s.match(req.request_id, prompt_tokens(req), 0, request_extras(req, BS))
    plan = s.build(
        [Scheduled(req.request_id, req.all_token_ids, 0, req.num_prompt_tokens)],
        lambda _r: list(range(100)),
    )
    s.on_events([Event(Op.SAVE, op.key, True) for op in plan.saves])
    s.after_alloc(req.request_id, [], 0)
    s.finished(req.request_id)
    return hit


def hit(s: SchedulerSide, req: Request) -> int:
    got, _ = s.match(req.request_id, prompt_tokens(req), 0, request_extras(req, BS))
    s.after_alloc(req.request_id, [], 0)
    s.finished(req.request_id)
    return got


def test_a_request_without_extras_keeps_the_plain_token_chain() -> None:
    req = request("plain")
    assert request_extras(req, BS) is None
    assert keys(req) == chain_keys(PROMPT, BS)
    # vLLM gives none of its blocks extra keys either: the short cut loses nothing
    assert all(
        generate_block_hash_extra_keys(req, b * BS, (b + 1) * BS, 0)[0] is None
        for b in range(len(PROMPT) // BS)
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"cache_salt": "s"},
        {"lora_request": LoRARequest("a", 1, "/adapters/a")},
        {"mm_features": [image("img", 8)]},
        {"prompt_embeds": torch.ones(len(PROMPT), 8)},
    ],
    ids=["cache_salt", "lora", "mm", "prompt_embeds"],
)
def test_every_input_vllm_keys_blocks_by_makes_the_request_keyed_with_extras(
    kw: dict[str, Any],
) -> None:
    tokens = None if "prompt_embeds" in kw else PROMPT
    req = request("r", tokens, **kw)
    assert has_extras(req)
    assert any(
        generate_block_hash_extra_keys(req, b * BS, (b + 1) * BS, 0)[0] is not None
        for b in range(len(PROMPT) // BS)
    )
    assert keys(req) != chain_keys(prompt_tokens(req), BS)


def test_vllm_request_fields_are_the_ones_reviewed_for_keys() -> None:
    # Each of vLLM 0.32's Request inputs was reviewed for whether it changes the KV: keyed
    # (prompt tokens, prompt_embeds, prompt_is_token_ids, mm_features, lora_request,
    # cache_salt) or not (the rest). A vLLM upgrade that adds one fails here until reviewed.
    params = set(inspect.signature(Request.__init__).parameters) - {"self"}
    assert params == {
        "request_id", "prompt_token_ids", "sampling_params", "pooling_params",
        "client_index", "arrival_time", "prompt_embeds", "prompt_is_token_ids",
        "mm_features", "lora_request", "cache_salt", "priority", "trace_headers",
        "block_hasher", "resumable", "session_id", "reasoning_ended",
        "reasoning_parser_kwargs", "abort_immediately", "kv_hints",
    }  # fmt: skip


def test_the_same_tokens_under_two_salts_never_share_pages() -> None:
    s = side()
    assert save(s, request("a1", cache_salt="tenant-a")) == 0
    assert hit(s, request("a2", cache_salt="tenant-a")) == HIT  # within a salt: a hit
    assert hit(s, request("b1", cache_salt="tenant-b")) == 0
    assert hit(s, request("n1")) == 0  # an unsalted request never reads a salted page
    assert save(s, request("n2")) == 0
    assert hit(s, request("a3", cache_salt="tenant-a")) == HIT
    assert hit(s, request("b2", cache_salt="tenant-b")) == 0
    assert hit(s, request("n3")) == HIT


def test_two_lora_adapters_never_share_pages() -> None:
    s = side()
    a = LoRARequest("a", 1, "/adapters/a")
    assert save(s, request("a1", lora_request=a)) == 0
    assert hit(s, request("a2", lora_request=LoRARequest("a", 7, "/adapters/a"))) == HIT
    assert hit(s, request("b1", lora_request=LoRARequest("b", 2, "/adapters/b"))) == 0
    # the same name re-pointed at another adapter's files (vLLM keys the path too)
    assert hit(s, request("a3", lora_request=LoRARequest("a", 1, "/adapters/a-v2"))) == 0
    assert hit(s, request("base")) == 0


def test_images_behind_the_same_placeholder_tokens_key_by_their_hash_and_offset() -> None:
    cat = keys(request("cat", mm_features=[image("cat", 9)]))
    dog = keys(request("dog", mm_features=[image("dog", 9)]))
    plain = chain_keys(PROMPT, BS)
    # blocks 0 and 1 end before the image: shared; block 2 on (the image starts there) not
    assert cat[:2] == dog[:2] == plain[:2]
    assert all(c != d for c, d in zip(cat[2:], dog[2:], strict=True))
    assert not set(cat[2:]) & set(plain)
    # the same image one token later: same placeholder tokens, another position in block 2
    later = keys(request("cat+1", mm_features=[image("cat", 10)]))
    assert later[:2] == cat[:2]
    assert all(c != d for c, d in zip(cat[2:], later[2:], strict=True))
    # and the same image twice gives the same keys
    assert keys(request("cat2", mm_features=[image("cat", 9)])) == cat


def test_later_images_are_found_when_keys_continue_from_a_block_past_the_first() -> None:
    # Keys computed in two calls (the prompt, then later blocks) equal one call's: the reader
    # finds the multimodal item a block starts at as vLLM's own block hasher does.
    req = request("two", mm_features=[image("a", 2, 3), image("b", 13, 10), image("c", 30, 4)])
    whole = RequestExtras(req, BS).digests(0, 10)
    assert RequestExtras(req, BS).digests(0, 4) + RequestExtras(req, BS).digests(4, 10) == whole
    # a: tokens 2-4 (blocks 0, 1); b: 13-22 (blocks 3-5); c: 30-33 (blocks 7, 8)
    assert [d is not None for d in whole] == [
        True, True, False, True, True, True, False, True, True, False,
    ]  # fmt: skip


def test_prompt_embeddings_key_by_their_digest() -> None:
    ones = keys(request("e1", None, prompt_embeds=torch.ones(len(PROMPT), 8)))
    again = keys(request("e2", None, prompt_embeds=torch.ones(len(PROMPT), 8)))
    other = torch.ones(len(PROMPT), 8)
    other[17, 3] = 2.0  # one value in block 4
    changed = keys(request("e3", None, prompt_embeds=other))
    assert ones == again
    assert changed[:4] == ones[:4]
    assert all(a != b for a, b in zip(changed[4:], ones[4:], strict=True))


def test_a_prompt_mixing_ids_and_embeddings_keys_which_positions_are_ids() -> None:
    # vLLM zeroes the ids at embedding positions: its mask tells a token 0 from an embedding.
    tokens = [0 if i == 5 else t for i, t in enumerate(PROMPT)]
    embeds = torch.ones(len(PROMPT), 8)
    as_id = [True] * len(PROMPT)
    as_embed = [i != 5 for i in range(len(PROMPT))]
    a = keys(request("m1", tokens, prompt_embeds=embeds, prompt_is_token_ids=as_id))
    b = keys(request("m2", tokens, prompt_embeds=embeds, prompt_is_token_ids=as_embed))
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def future_extra_keys(req: Any, start: int, end: int, mm: int) -> tuple[Any, int]:
    """vLLM's extra keys as a later vLLM might give them: a kind hicache does not know."""
    extra, mm = generate_block_hash_extra_keys(req, start, end, mm)
    return (*(extra or ()), ("lora_scale", 0.5)), mm


@pytest.mark.parametrize("case", ["unknown kind", "item without identifier"])
def test_a_request_hicache_cannot_key_is_neither_matched_nor_saved_and_is_counted(
    case: str,
) -> None:
    s = side()
    if case == "unknown kind":
        req = request("x", lora_request=LoRARequest("a", 1, "/adapters/a"))
        extras = RequestExtras(req, BS, extra_keys=future_extra_keys)
        reason = "lora_scale"
    else:  # vLLM's own extra-key function refuses it (an assert)
        req = request("x", mm_features=[image(None, 9)])
        extras = RequestExtras(req, BS)
        reason = "AssertionError"
    plain = request("p", lora_request=LoRARequest("a", 1, "/adapters/a"))
    save(s, plain)  # a page with the same tokens and adapter exists
    with structlog.testing.capture_logs() as logs:
        assert s.match("x", prompt_tokens(req), 0, extras) == (0, False)
        plan = s.build(
            [Scheduled("x", req.all_token_ids, 0, len(PROMPT))], lambda _r: list(range(100))
        )
        plan2 = s.build(
            [Scheduled("x", [*req.all_token_ids, 5, 6, 7], len(PROMPT), 3)],
            lambda _r: list(range(100)),
        )
    assert plan.saves == []
    assert plan2.saves == []
    assert s.stats.snapshot()["unkeyable_requests"] == 1
    (log,) = [e for e in logs if e["event"] == "vllm.request_not_cached"]
    assert log["request"] == "x"
    assert reason in log["reason"]
    assert s.stats.counters.statistics().errors  # hicache's own metrics count it too
