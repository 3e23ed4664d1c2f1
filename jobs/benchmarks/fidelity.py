"""The suite's fidelity part: a real GPT run with no injected sleeps (the default model on
`--varlen` data, the in-process backend: one thread per stage, in-memory links), each timed
iteration replayed in the simulator on its own measured trace (`rrfp_ray.sim.replay`), for fixed
1F1B and bf at each P. It shows how far the simulator is from real ops on this machine, and what
bf buys over 1F1B when nothing is injected."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.rows import FidelityRow
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.replay import replay

log = logging.getLogger(__name__)

POLICIES = ("1f1b", "bf")


def fidelity_part(*, stages: Sequence[int], warmup: int, iterations: int) -> dict[str, Any]:
    from rrfp_ray.recipes.config import RunConfig, TrainConfig
    from rrfp_ray.recipes.gpt_workload import gpt_trainer
    from rrfp_ray.train.config import PipelineConfig

    rows = []
    for p in stages:
        for name in POLICIES:
            pipeline = PipelineConfig(stages=p, microbatches=4 * p, policy=name)
            run = RunConfig(
                pipeline=pipeline, train=TrainConfig(iterations=warmup + iterations, varlen=True, val_every=0)
            )
            with gpt_trainer(run) as trainer:
                reports = [trainer.step(policy=name) for _ in range(warmup + iterations)][warmup:]
            policy = pipeline.resolved_policy(name)
            layout = Layout(stages=p, chunks=1, microbatches=4 * p)
            replays = [replay(r, policy=policy, layout=layout, cap=pipeline.cap) for r in reports]
            row = FidelityRow(
                stages=p,
                microbatches=4 * p,
                policy=name,
                cap=str(pipeline.cap),
                runs_ms=tuple(r.makespan_ms for r in reports),
                measured_ms=statistics.median(r.makespan_ms for r in reports),  # with the optimizer step
                schedule_ms=statistics.median(x.measured_ms for x in replays),  # without it, as simulated
                simulated_ms=statistics.median(x.simulated_ms for x in replays),
                sim_over_measured=statistics.median(x.ratio for x in replays),
                op_ms_mean=statistics.mean(e.end_ms - e.start_ms for r in reports for e in r.events),
            )
            rows.append(asdict(row))
            log.info(
                f"fidelity P={p} {name:<5} measured {row.schedule_ms:8.1f} ms, replayed {row.simulated_ms:8.1f} "
                f"ms (sim/meas {row.sim_over_measured:.3f}), ops {row.op_ms_mean:.1f} ms on average"
            )
    return {"rows": rows, "warmup": warmup, "iterations": iterations}
