"""Counters a serving-framework integration feeds into hicache's metrics (no dependency).

- IntegrationCounters(source): thread-safe counters one integration (a vLLM KV connector, an
  SGLang storage backend, ...) updates where it already measures: ``count_lookup`` (tokens
  asked, hit tokens per tier), ``count_load`` / ``count_save`` (pages, bytes, seconds, ok or
  not), ``count_error`` (operation, status). ``statistics()`` is a frozen
  IntegrationStatistics; ``metric_families()`` makes it a MetricsSource for HiCacheMetrics
  (label ``source``).

docs/metrics.md, "Integrations", shows the calls.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Mapping

import attrs

from hicache.domain.errors import ConfigError
from hicache.domain.tiers import PerTier, Tier
from hicache.engine.histogram import (
    LOAD_SECONDS_BUCKETS,
    Histogram,
    HistogramSnapshot,
)
from hicache.metrics.families import TIERS, Family, FamilyBuilder

_LABEL = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


def _label(arg: str, value: object) -> str:
    if not isinstance(value, str) or not _LABEL.match(value):
        raise ConfigError(
            f"{arg} must be 1-64 letters, digits or _ . : - (a label value), got {value!r}"
        )
    return value


def _count(arg: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{arg} must be a non-negative integer, got {value!r}")
    return value


def _seconds(arg: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ConfigError(f"{arg} must be a non-negative number of seconds, got {value!r}")
    return float(value)


def _hits(arg: str, value: object) -> PerTier:
    if isinstance(value, PerTier):
        hits = value
    elif isinstance(value, Mapping):
        unknown = [k for k in value if k not in TIERS and not isinstance(k, Tier)]
        if unknown:
            raise ConfigError(f"{arg}: unknown tiers {unknown!r}, expected {list(TIERS)}")
        named = {(k.name.lower() if isinstance(k, Tier) else k): v for k, v in value.items()}
        hits = PerTier(**{t: named.get(t, 0) for t in TIERS})
    else:
        raise ConfigError(
            f"{arg} must be a PerTier or a mapping of tier to tokens, got {type(value).__name__}"
        )
    for tier in TIERS:
        _count(f"{arg}.{tier}", getattr(hits, tier))
    return hits


@attrs.frozen(kw_only=True)
class IntegrationStatistics:
    """What one integration counted since its IntegrationCounters was built."""

    source: str
    lookups: int
    lookup_tokens: int
    hit_tokens: PerTier
    loads: Mapping[str, int]  # by outcome: ok, failed
    loaded_pages: int
    loaded_bytes: int
    load_seconds: HistogramSnapshot
    saves: Mapping[str, int]
    saved_pages: int
    saved_bytes: int
    save_seconds: HistogramSnapshot
    errors: Mapping[tuple[str, str], int]  # (operation, status) -> count

    @property
    def miss_tokens(self) -> PerTier:
        """Per tier, tokens looked for there and found neither there nor above."""
        device = self.lookup_tokens - self.hit_tokens.device
        host = device - self.hit_tokens.host
        return PerTier(device=device, host=host, storage=host - self.hit_tokens.storage)


class IntegrationCounters:
    """Counters of one integration (label ``source``); every method may be called from any
    thread. See docs/metrics.md, "Integrations"."""

    def __init__(self, source: str) -> None:
        self.source = _label("source", source)
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter()
        self._hits = [0, 0, 0]
        self._errors: Counter[tuple[str, str]] = Counter()
        self._load_s = Histogram(LOAD_SECONDS_BUCKETS)
        self._save_s = Histogram(LOAD_SECONDS_BUCKETS)

    def count_lookup(self, *, tokens: int, hit_tokens: PerTier | Mapping[str, int]) -> None:
        """One lookup of ``tokens`` tokens and what each tier served of it (``PerTier`` or
        ``{"host": 256, "storage": 128}``: host beyond the device hit, storage beyond host)."""
        tokens = _count("tokens", tokens)
        hits = _hits("hit_tokens", hit_tokens)
        if hits.total > tokens:
            raise ConfigError(
                f"hit_tokens {hits.as_dict()} add up to {hits.total}, more than tokens={tokens}"
            )
        with self._lock:
            self._c["lookups"] += 1
            self._c["lookup_tokens"] += tokens
            for i, tier in enumerate(TIERS):
                self._hits[i] += getattr(hits, tier)

    def count_load(self, *, pages: int, nbytes: int, seconds: float, ok: bool = True) -> None:
        """One load into the framework's memory (``seconds``: from its start to its end)."""
        self._transfer("load", self._load_s, pages, nbytes, seconds, ok)

    def count_save(self, *, pages: int, nbytes: int, seconds: float, ok: bool = True) -> None:
        """One save out of the framework's memory (to host or storage)."""
        self._transfer("save", self._save_s, pages, nbytes, seconds, ok)

    def _transfer(
        self, kind: str, hist: Histogram, pages: int, nbytes: int, seconds: float, ok: object
    ) -> None:
        pages = _count("pages", pages)
        nbytes = _count("nbytes", nbytes)
        secs = _seconds("seconds", seconds)
        if not isinstance(ok, bool):
            raise ConfigError(f"ok must be True or False, got {ok!r}")
        with self._lock:
            self._c[f"{kind}s_{'ok' if ok else 'failed'}"] += 1
            self._c[f"{kind}_pages"] += pages
            self._c[f"{kind}_bytes"] += nbytes
        hist.observe(secs)

    def count_error(self, *, operation: str, status: str) -> None:
        """One failed call of ``operation`` (e.g. ``get``, ``put``, ``exists``) with ``status``
        (e.g. ``transient``, ``fatal``, ``timeout``, or an exception's class name)."""
        key = (_label("operation", operation), _label("status", status))
        with self._lock:
            self._errors[key] += 1

    def statistics(self) -> IntegrationStatistics:
        with self._lock:
            c = Counter(self._c)
            hits = PerTier.from_counts(self._hits)
            errors = dict(self._errors)
        return IntegrationStatistics(
            source=self.source,
            lookups=c["lookups"],
            lookup_tokens=c["lookup_tokens"],
            hit_tokens=hits,
            loads={"ok": c["loads_ok"], "failed": c["loads_failed"]},
            loaded_pages=c["load_pages"],
            loaded_bytes=c["load_bytes"],
            load_seconds=self._load_s.snapshot(),
            saves={"ok": c["saves_ok"], "failed": c["saves_failed"]},
            saved_pages=c["save_pages"],
            saved_bytes=c["save_bytes"],
            save_seconds=self._save_s.snapshot(),
            errors=errors,
        )

    def metric_families(self) -> list[Family]:
        s = self.statistics()
        f = FamilyBuilder({"source": s.source})
        p = "hicache_integration"
        f.add(f"{p}_lookups", "counter", "lookups the integration made", s.lookups)
        f.add(f"{p}_lookup_tokens", "counter", "tokens the lookups asked for", s.lookup_tokens)
        f.per_tier(
            f"{p}_hit_tokens",
            "tokens the lookups found, by the tier that served them",
            s.hit_tokens,
        )
        f.per_tier(
            f"{p}_miss_tokens",
            "tokens looked for on the tier and found neither there nor above",
            s.miss_tokens,
        )
        for kind, outcomes, pages, nbytes, hist in (
            ("load", s.loads, s.loaded_pages, s.loaded_bytes, s.load_seconds),
            ("save", s.saves, s.saved_pages, s.saved_bytes, s.save_seconds),
        ):
            for outcome, n in outcomes.items():
                f.add(f"{p}_{kind}s", "counter", f"{kind}s by outcome", n, outcome=outcome)
            done = "loaded" if kind == "load" else "saved"
            f.add(f"{p}_{done}_pages", "counter", f"pages {done}", pages)
            f.add(f"{p}_{done}_bytes", "counter", f"bytes {done}", nbytes)
            f.add(f"{p}_{kind}_seconds", "histogram", f"per {kind}: its duration", hist)
        for (op, status), n in sorted(s.errors.items()):
            f.add(
                f"{p}_errors",
                "counter",
                "failed calls by operation and status",
                n,
                operation=op,
                status=status,
            )
        return f.build()

    def __repr__(self) -> str:
        return f"<IntegrationCounters {self.source!r}>"


__all__ = ["IntegrationCounters", "IntegrationStatistics"]
