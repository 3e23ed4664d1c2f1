"""The planner's fast paths give what the plain ones give: medians, reordered and replaced traces."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rrfp_ray.plan.fits import median
from rrfp_ray.plan.scoring import reordered, replaced
from rrfp_ray.sim.variability import generate


@pytest.mark.parametrize("size", [1, 2, 3, 8, 63, 64, 65, 128, 1001])
def test_median_is_numpys(size: int) -> None:
    rng = np.random.default_rng(size)
    for values in (rng.lognormal(size=size), np.round(rng.random(size), 1), np.ones(size)):
        assert median(values) == float(np.median(values))
    values = rng.random(size)
    values[rng.integers(0, size)] = np.nan
    assert math.isnan(median(values))


@pytest.mark.parametrize(
    ("scenario", "chunks", "docs"), [("varlen+lognormal", 1, 3), ("multimodal+lognormal", 2, None)]
)
def test_reordered_and_replaced_are_the_traces_own(scenario: str, chunks: int, docs: int | None) -> None:
    extra = {} if docs is None else {"docs": docs}
    trace = generate(scenario=scenario, stages=3, chunks=chunks, microbatches=6, seed=1, **extra)
    order = (4, 0, 5, 2, 1, 3)
    assert reordered(trace, order) == trace.reordered(order)
    rows = np.random.default_rng(0).random((trace.virtual_stages, trace.microbatches))
    assert replaced(trace, F=rows, activation_bytes=None) == replace(trace, F=rows.tolist(), activation_bytes=None)


def test_replaced_refuses_what_a_trace_refuses() -> None:
    trace = generate(scenario="lognormal", stages=2, chunks=1, microbatches=4, seed=0)
    bad = np.ones((2, 4))
    bad[1, 2] = -1.0
    with pytest.raises(ValueError, match=r"F\[1\]\[2\]"):
        replaced(trace, F=bad)
    with pytest.raises(ValueError, match="microbatches"):
        replaced(trace, B=np.ones((2, 3)))
