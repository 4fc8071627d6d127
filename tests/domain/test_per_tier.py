"""PerTier: per-tier statistics are read by name, and a wrong tier or count is a typed error."""

from __future__ import annotations

import json

import pytest

from hicache.domain import ConfigError, PerTier
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
