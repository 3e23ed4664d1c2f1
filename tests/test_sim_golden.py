"""The simulator's makespans for every policy, scenario, seed and cap, bit for bit as recorded
before the tree was reorganised (`tests/data/sim_makespans.json`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import make_policy, policy_names
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import SCENARIOS, generate

GOLDEN = Path(__file__).resolve().parent / "data" / "sim_makespans.json"


def test_makespans_are_unchanged_bit_for_bit():
    golden = json.loads(GOLDEN.read_text())
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
    assert seen.keys() == golden.keys()
    changed = {key: (golden[key], value) for key, value in seen.items() if value != golden[key]}
    assert not changed, f"{len(changed)} makespans changed, e.g. {next(iter(changed.items()))}"
