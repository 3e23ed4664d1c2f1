"""Fast paths give what the plain ones give: the fits' median, and a trace's reordered and replaced copies."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from rrfp_ray.plan.fits import median
from rrfp_ray.sim.trace import COMM_KEYS, OP_KEYS, Trace
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
    assert trace.reordered(order) == _moved(trace, order)
    rows = np.random.default_rng(0).random((trace.virtual_stages, trace.microbatches))
    assert trace.replaced(F=rows, activation_bytes=None) == replace(trace, F=rows.tolist(), activation_bytes=None)


def _moved(trace: Trace, order: tuple[int, ...]) -> Trace:
    """`trace` with every column moved to its slot number by number, checked again as `Trace` checks it."""
    rows = {key: [[row[j] for j in order] for row in getattr(trace, key)] for key in (*OP_KEYS, *COMM_KEYS)}
    if trace.features is not None:
        rows["features"] = [trace.features[j] for j in order]
    if trace.activation_bytes is not None:
        rows["activation_bytes"] = [[row[j] for j in order] for row in trace.activation_bytes]
    if trace.samples is not None:
        rows["samples"] = [list(trace.samples[j]) for j in order]
    return replace(trace, **rows)


def test_replaced_refuses_what_a_trace_refuses() -> None:
    trace = generate(scenario="lognormal", stages=2, chunks=1, microbatches=4, seed=0)
    bad = np.ones((2, 4))
    bad[1, 2] = -1.0
    with pytest.raises(ValueError, match=r"F\[1\]\[2\]"):
        trace.replaced(F=bad)
    with pytest.raises(ValueError, match="microbatches"):
        trace.replaced(B=np.ones((2, 3)))
