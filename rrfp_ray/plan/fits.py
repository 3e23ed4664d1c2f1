"""A line fitted robustly through (feature, value) observations: the cost model's `Fit` and how it is found
(`robust_fit`, Theil-Sen: the median of pairwise slopes, so a block whose cost does not follow the feature learns
a slope near 0; the spread is the robust standard deviation of the log residuals)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

_MAD = 1.4826  # MAD to standard deviation under a normal law


@dataclass(frozen=True)
class Fit:
    """duration = intercept + slope * feature, with the log-spread of one op around it."""

    intercept: float
    slope: float
    sigma: float = 0.0

    def predict(self, feature: float) -> float:
        return max(0.0, self.intercept + self.slope * feature)

    def __add__(self, other: Fit) -> Fit:
        return Fit(
            intercept=self.intercept + other.intercept,
            slope=self.slope + other.slope,
            sigma=math.hypot(self.sigma, other.sigma),
        )


def median(values: np.ndarray) -> float:
    """`np.median` of a non-empty 1-d array, to the bit, without its per-call overhead (a fit takes four): sorted
    where short, else partitioned about its middle and its last place (where a NaN would go, as in `np.median`)."""
    n = values.size
    k = n // 2
    part = np.sort(values) if n <= 64 else np.partition(values, (k - 1, k, -1))
    if np.isnan(part[-1]):
        return math.nan
    return float(part[k]) if n % 2 else float((part[k - 1] + part[k]) / 2)


@functools.lru_cache(maxsize=64)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs (i, j), i < j, of n points, row by row."""
    return np.triu_indices(n, k=1)


def robust_fit(features: np.ndarray, values: np.ndarray) -> Fit:
    """Theil-Sen line through (feature, value) with the slope kept >= 0; intercept the median offset."""
    i, j = _pairs(features.size)
    dx = features[j] - features[i]
    apart = np.abs(dx) > 1e-9 * max(1.0, float(np.abs(features).max()))
    slope = max(0.0, median((values[j] - values[i])[apart] / dx[apart])) if apart.any() else 0.0
    intercept = median(values - slope * features)
    fitted = np.maximum(intercept + slope * features, 1e-12)
    residual = np.log(np.maximum(values, 1e-12) / fitted)
    sigma = _MAD * median(np.abs(residual - median(residual)))
    return Fit(intercept=intercept, slope=slope, sigma=sigma)
