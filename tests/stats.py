"""Small statistics helpers for distribution tests (no SciPy dependency)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (Wilson-Hilferty approximation)."""
    if x <= 0:
        return 1.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square(samples: Sequence[int], probs: Sequence[float]) -> tuple[float, float]:
    """Pearson chi-square of samples against probabilities (cells with p = 0 must be empty)."""
    counts = Counter(samples)
    n = len(samples)
    stat, df = 0.0, -1
    for token, p in enumerate(probs):
        if p == 0:
            assert counts.get(token, 0) == 0, f"token {token} has probability 0 but was sampled"
            continue
        expected = n * p
        stat += (counts.get(token, 0) - expected) ** 2 / expected
        df += 1
    assert not set(counts) - set(range(len(probs))), "sampled a token outside the vocabulary"
    return stat, chi2_sf(stat, max(df, 1))
