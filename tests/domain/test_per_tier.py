"""PerTier: per-tier statistics are read by name, and a wrong tier or count is a typed error;
the index counts pages per tier (what a scrape reads) as a count of each record would."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.domain import ConfigError, PerTier, PoolName
from hicache.domain.index_pages import PageRecord, count_pages
from hicache.domain.tiers import Tier


def test_a_per_tier_figure_is_read_by_name_or_by_tier_and_serialises_with_names() -> None:
    hits = PerTier.from_counts([0, 256, 128])
    assert (hits.device, hits.host, hits.storage) == (0, 256, 128)
    assert [hits.of(t) for t in Tier] == [0, 256, 128]
    assert hits.total == 384
    assert json.loads(json.dumps(hits.as_dict())) == {"device": 0, "host": 256, "storage": 128}


def test_per_tier_refuses_a_wrong_number_of_counts_and_a_tier_that_is_not_a_tier() -> None:
    with pytest.raises(ConfigError, match=r"expected 3 counts .* got \[1, 2\]"):
        PerTier.from_counts([1, 2])
    with pytest.raises(ConfigError, match="tier must be a Tier, got 'host'"):
        PerTier(host=1).of("host")  # type: ignore[arg-type]


@given(
    st.lists(
        st.tuples(
            st.tuples(st.booleans(), st.booleans(), st.booleans()),
            st.tuples(*(st.integers(0, 3) for _ in range(3))),
        ),
        max_size=40,
    ),
    st.lists(st.integers(0, 50), min_size=3, max_size=3),
)
def test_index_counts_per_tier_match_a_count_of_each_record(
    records: list[tuple[tuple[bool, bool, bool], tuple[int, int, int]]], evictions: list[int]
) -> None:
    built = []
    for i, (at, pins) in enumerate(records):
        r = PageRecord(i.to_bytes(8, "big"), 1)
        r.at = [{PoolName.KV: i} if here else None for here in at]
        r.pins = list(pins)
        built.append(r)
    s = count_pages(built, tickets=2, evictions=evictions)
    assert s.pages == len(records)
    for t in Tier:
        assert s.on_tier.of(t) == sum(at[t] for at, _ in records)
        assert s.pinned.of(t) == sum(pins[t] > 0 for _, pins in records)
        assert s.evictions.of(t) == evictions[t]
    assert s.in_flight == 2
