"""Load or recompute: how much of a cache hit is worth loading (pure: figures passed in).

- PageCost: a tier's measured seconds per page (an EWMA of completed transfers; None before the
  first one) and the seconds of work already queued on it.
- PrefillModel: this engine's step time as a function of what a step computes, fitted online
  from observed steps: ``seconds = a + b * tokens + c * attention`` where ``attention`` is the
  sum over the step's requests of ``n * (context + n / 2)`` (n tokens computed after
  ``context`` tokens already held: attention grows with the context). Non-negative least squares
  over decayed sums (old steps weigh less, by the tokens computed since); ``saved(n, h)``: the
  seconds saved by not computing tokens ``[n, n + h)`` of a prompt (``b * h + c * h * (n + h /
  2)``), None until fitted.
- choose_end(...): of a hit split into a host run and a store run, the end (in blocks) that
  gains most: compute saved minus load time, where a load costs the tier's queued work plus
  its pages at the tier's seconds per page; the store run also pays the host copy and a fixed
  latency (an asynchronous load waits for an extra engine step). Unmeasured figures are
  optimistic (a tier never measured is tried, so that it gets measured; without a prefill
  model every hit is loaded).

The gain ``saved(start, end) - load(end)`` is convex in ``end`` within a run (saved grows at
least linearly, load linearly), so its maximum over a run is at one of the run's ends: the
candidates are the hit's start (load nothing), the end of the host run and the end of the store
run.
"""

from __future__ import annotations

import itertools

import attrs

# Weight of the newest sample in a tier's EWMA of seconds per page.
EWMA_ALPHA = 0.3
# Older steps' weight in the prefill fit is multiplied by PREFILL_DECAY per DECAY_TOKENS tokens
# computed since: forgetting follows work done, so the many one-token decode steps between two
# prefills do not wash the prefills' figure out.
PREFILL_DECAY = 0.98
DECAY_TOKENS = 1024
# Attention work is counted in thousands of token pairs (keeps the fit's sums well scaled).
ATTENTION_UNIT = 1000.0


@attrs.define
class PageCost:
    """One tier's measured cost: seconds per page (None: never measured) and queued seconds."""

    per_page_s: float | None = None
    samples: int = 0

    def observe(self, pages: int, seconds: float, *, alpha: float = EWMA_ALPHA) -> None:
        """A completed transfer of ``pages`` pages that took ``seconds``."""
        if pages <= 0 or seconds < 0:
            return
        sample = seconds / pages
        if self.per_page_s is None:
            self.per_page_s = sample
        else:
            self.per_page_s += alpha * (sample - self.per_page_s)
        self.samples += 1

    def seconds(self, pages: int) -> float:
        """The estimated seconds of ``pages`` pages (0 before the first measurement)."""
        return pages * (self.per_page_s or 0.0)


def attention_work(tokens: int, context: int) -> float:
    """The attention work of computing ``tokens`` tokens after ``context`` held ones."""
    return tokens * (context + tokens / 2) / ATTENTION_UNIT


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [[*row, rhs] for row, rhs in zip(m, v, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        scale = max(abs(a[r][col]) for r in range(n)) or 1.0
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    return [a[i][n] / a[i][i] for i in range(n)]


@attrs.define
class PrefillModel:
    """Online non-negative fit of step seconds = a + b * tokens + c * attention."""

    decay: float = PREFILL_DECAY
    # decayed sums: X^T X (3x3), X^T y (3), and counts of steps with more than one token
    _xtx: list[list[float]] = attrs.field(factory=lambda: [[0.0] * 3 for _ in range(3)])
    _xty: list[float] = attrs.field(factory=lambda: [0.0] * 3)
    _yy: float = 0.0
    prefill_steps: int = 0
    steps: int = 0
    _coef: tuple[float, float, float] | None = None

    def observe(self, tokens: int, attention: float, seconds: float) -> None:
        """One engine step that computed ``tokens`` tokens (``attention``: attention_work summed
        over its requests) in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        x = (1.0, float(tokens), float(attention))
        d = self.decay ** (tokens / DECAY_TOKENS)
        for i in range(3):
            self._xty[i] = d * self._xty[i] + x[i] * seconds
            for j in range(3):
                self._xtx[i][j] = d * self._xtx[i][j] + x[i] * x[j]
        self._yy = d * self._yy + seconds * seconds
        self.steps += 1
        if tokens > 1:
            self.prefill_steps += 1
        self._coef = None

    @property
    def fitted(self) -> bool:
        """Whether a step with more than one token was seen (decode steps alone say nothing of
        what a long prefill costs)."""
        return self.prefill_steps > 0

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, c), each >= 0: the best of the fits over every subset of the three terms."""
        if self._coef is None:
            self._coef = self._fit()
        return self._coef

    def _fit(self) -> tuple[float, float, float]:
        best: tuple[float, tuple[float, float, float]] | None = None
        # the per-token terms first: where the steps cannot tell them from the fixed cost
        # (every step of one size), a prompt's cost is put on its tokens, not on the step
        for size in (3, 2, 1):
            for subset in sorted(itertools.combinations(range(3), size), key=lambda s: 0 in s):
                m = [[self._xtx[i][j] for j in subset] for i in subset]
                sol = _solve(m, [self._xty[i] for i in subset])
                if sol is None or any(s < 0 for s in sol):
                    continue
                beta = [0.0, 0.0, 0.0]
                for i, s in zip(subset, sol, strict=True):
                    beta[i] = s
                rss = self._rss(beta)
                if best is None or rss < best[0] - 1e-9 * abs(best[0]) - 1e-15:
                    best = (rss, (beta[0], beta[1], beta[2]))
        return best[1] if best is not None else (0.0, 0.0, 0.0)

    def _rss(self, beta: list[float]) -> float:
        quad = sum(beta[i] * self._xtx[i][j] * beta[j] for i in range(3) for j in range(3))
        return self._yy - 2 * sum(b * y for b, y in zip(beta, self._xty, strict=True)) + quad

    def step_s(self, tokens: int, attention: float) -> float:
        a, b, c = self.coefficients()
        return a + b * tokens + c * attention

    def saved(self, context: int, tokens: int) -> float | None:
        """Seconds saved by not computing ``tokens`` tokens after ``context`` held ones (None
        until fitted)."""
        if not self.fitted:
            return None
        _, b, c = self.coefficients()
        return b * tokens + c * attention_work(tokens, context)


@attrs.frozen
class HitCosts:
    """What choose_end weighs for one hit (seconds; per-page figures None: never measured)."""

    host_page_s: float | None  # host -> device, per page
    store_page_s: float | None  # store -> host, per page (then also host_page_s)
    host_queued_s: float = 0.0
    store_queued_s: float = 0.0
    store_latency_s: float = 0.0  # fixed cost of an asynchronous load (an extra engine step)


def load_seconds(costs: HitCosts, start: int, host_end: int, end: int) -> float | None:
    """Seconds to load blocks ``[start, end)`` (host run ``[start, host_end)``); None when a
    tier it needs was never measured (then it is tried)."""
    host_pages = max(0, min(end, host_end) - start)
    store_pages = max(0, end - max(host_end, start))
    if host_pages + store_pages == 0:
        return 0.0
    if costs.host_page_s is None or (store_pages and costs.store_page_s is None):
        return None
    seconds = costs.host_queued_s + (host_pages + store_pages) * costs.host_page_s
    if store_pages:
        assert costs.store_page_s is not None
        seconds += costs.store_queued_s + costs.store_latency_s
        seconds += store_pages * costs.store_page_s
    return seconds


def choose_end(
    *,
    start: int,
    host_end: int,
    end: int,
    block_size: int,
    costs: HitCosts,
    saved: PrefillModel,
) -> int:
    """The end block of the prefix worth loading, in ``[start, end]`` (``start``: load nothing).

    Blocks ``[start, host_end)`` are on the host, ``[host_end, end)`` in the store. A candidate
    whose load time is unknown (a tier never measured) or whose compute time is unknown (no
    prefill model yet) is taken as worth loading; among known ones the largest gain wins, ties
    to the longer prefix."""
    host_end = min(max(host_end, start), end)
    if end <= start:
        return start
    candidates = sorted({start, host_end, end})
    best, best_gain = start, 0.0
    for cand in candidates[1:]:
        load = load_seconds(costs, start, host_end, cand)
        gain_s = saved.saved(start * block_size, (cand - start) * block_size)
        if load is None or gain_s is None:
            best = cand  # unmeasured: try it (optimistic), the longest such prefix
            best_gain = float("inf")
            continue
        gain = gain_s - load
        if gain >= best_gain and gain > 0:
            best, best_gain = cand, gain
    return best
