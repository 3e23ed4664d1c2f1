"""The simulator's makespans for every policy, scenario, seed and cap, as recorded in `tests/data/sim_makespans.json`,
to a relative tolerance of 1e-9 rather than bit for bit.

The traces' lognormal factors come from numpy's vectorised `exp`, whose last bit differs between the code paths numpy
dispatches to at run time (AVX-512 or AVX2 or the baseline, by CPU and numpy version). A makespan sums and maxes some
hundred op durations, so such a difference moves it by a few units in the last place (about 1e-16 relative each, under
1e-13 in all). A changed scheduling decision that shows in a makespan moves it by a difference of op durations, a
fraction of a millisecond or more, where 1e-9 of a makespan under 10^4 ms is 1e-5 ms. The tolerance is tight on
purpose: rewrites of the simulator's loop are checked against it, so it must hide a changed rounding, never a changed
decision."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy, policy_names
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import SCENARIOS, generate

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "data" / "sim_makespans.json"
REL_TOL = 1e-9


def makespans(golden: dict[str, float]) -> dict[str, float]:
    """Every recorded case simulated again on this machine: key -> makespan (ms)."""
    seen = {}
    for stages, chunks, scenario, seed in itertools.product((3, 4), (1, 2), SCENARIOS, (0, 1)):
        trace = generate(scenario=scenario, stages=stages, microbatches=8, chunks=chunks, seed=seed)
        for name in policy_names():
            key_head = f"P{stages} M8 v{chunks} {scenario} seed{seed} {name}"
            if f"{key_head} cap1x" not in golden:
                continue
            policy = make_policy(name=name, stages=stages, chunks=chunks, microbatches=8)
            for cap in ("1x", "2x", "inf"):
                seen[f"{key_head} cap{cap}"] = simulate(policy=policy, trace=trace, cap=Cap.parse(cap)).makespan_ms
    return seen


def assert_matches_golden(seen: dict[str, float], golden: dict[str, float], *, where: str) -> None:
    assert seen.keys() == golden.keys()
    changed = {
        key: (golden[key], value)
        for key, value in seen.items()
        if not math.isclose(value, golden[key], rel_tol=REL_TOL, abs_tol=0.0)
    }
    assert not changed, (
        f"{where}: {len(changed)} makespans changed by more than {REL_TOL:g}, e.g. {next(iter(changed.items()))}"
    )


def test_makespans_match_the_recorded_ones():
    golden = json.loads(GOLDEN.read_text())
    assert_matches_golden(makespans(golden), golden, where="this process")


def test_a_last_bit_passes_and_a_changed_duration_fails():
    """Each recorded makespan one unit in the last place off (as on a CPU with AVX-512: 1237.0847442024892 recorded,
    1237.084744202489 computed) still matches; one makespan 1e-4 ms off does not."""
    golden = json.loads(GOLDEN.read_text())
    assert_matches_golden({key: math.nextafter(value, 0.0) for key, value in golden.items()}, golden, where="ulp")
    key = next(iter(golden))
    with pytest.raises(AssertionError, match="1 makespans changed"):
        assert_matches_golden({**golden, key: golden[key] + 1e-4}, golden, where="changed")


def _numpy_cpu() -> tuple[list[str], dict[str, bool]]:
    """numpy's run-time dispatch targets (what NPY_DISABLE_CPU_FEATURES may name) and the CPU features it sees."""
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # numpy < 2
        from numpy.core import _multiarray_umath as umath
    return list(umath.__cpu_dispatch__), dict(umath.__cpu_features__)


CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_sim_golden import GOLDEN, _numpy_cpu, makespans
dispatch, features = _numpy_cpu()
golden = json.loads(GOLDEN.read_text())
print(json.dumps({"features": features, "makespans": makespans(golden)}))
"""


def test_makespans_match_the_recorded_ones_on_numpys_baseline_code_path():
    """The same comparison with every run-time dispatched numpy kernel turned off (AVX-512 and AVX2 on x86-64).

    Depends on the CPU: where it has none of numpy's dispatch targets (none of AVX-512 for float64 `exp`), the
    subprocess takes the same path as this process and checks nothing new. The names to disable come from numpy
    itself, because numpy reacts to names three ways: a dispatch target the CPU lacks is accepted and does nothing; a
    name that is not a dispatch target of this numpy (AVX512F and AVX512_SKX on numpy >= 2.4, which groups them as
    X86_V4) only raises an ImportWarning, hidden by default, and disables nothing; a baseline feature fails the import
    with a RuntimeError."""
    dispatch, features = _numpy_cpu()
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(dispatch)}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(HERE)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert not any(child["features"][name] for name in dispatch), f"still on: {child['features']}"
    golden = json.loads(GOLDEN.read_text())
    turned_off = [name for name in dispatch if features.get(name)] or ["nothing: this CPU has no dispatch target"]
    assert_matches_golden(child["makespans"], golden, where=f"with {', '.join(turned_off)} turned off")
