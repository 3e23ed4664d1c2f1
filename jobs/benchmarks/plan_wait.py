"""How long an iteration of `planned` waits for its plan, against the iteration: the GPT in one process.

Each iteration's plan is made on the Trainer's planning thread while the iteration before runs
(`rrfp_ray.plan.ahead`); what is left to wait when the iteration starts is `Trainer.plan_wait_s`.
The iteration is the wall time of `Trainer.step` (plan taken, iteration run, report back). Beside
it, the same run under the plans' first hint alone, taking turns with it, to show what planning on
a thread of the same process costs the iteration itself (the stages are threads of this process
too, and the simulator that scores plans is Python).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from rrfp_ray.plan.planner import default_hints
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.api import Trainer


@dataclass(frozen=True)
class Waits:
    wait_s: list[float]  # per planned iteration: the wait for its plan
    planning_s: list[float]  # per planned iteration: how long its plan took to make (nan: the last plan ran)
    step_s: list[float]  # per planned iteration: the wall time of Trainer.step
    fixed_step_s: list[float]  # the same iterations under the first hint alone

    @property
    def ratio(self) -> float:
        """Median wait over median iteration."""
        return statistics.median(self.wait_s) / statistics.median(self.step_s)


def run_config(*, layers: int, stages: int, microbatches: int, iterations: int, policy: str) -> RunConfig:
    return RunConfig(
        model={"n_layer": layers, "n_embd": 64, "n_head": 4, "block_size": 64, "tie_embeddings": False},
        pipeline={"stages": stages, "microbatches": microbatches, "policy": policy, "timeout_s": 60},
        train={"micro_batch_size": 4, "seq_len": 64, "iterations": iterations, "varlen": True},
    )


def _timed_step(trainer: Trainer) -> float:
    started = time.perf_counter()
    trainer.step()
    return time.perf_counter() - started


def measure(*, layers: int, stages: int, microbatches: int, iterations: int) -> Waits:
    """`iterations` of `planned` and of its first hint, the two trainers taking turns so that the machine's load
    hits both alike."""
    shape = {"layers": layers, "stages": stages, "microbatches": microbatches, "iterations": iterations}
    with (
        gpt_trainer(run_config(policy="planned", **shape)) as planned,
        gpt_trainer(run_config(policy=default_hints(chunks=1)[0], **shape)) as fixed,
    ):
        steps, fixed_steps = [], []
        for _ in range(iterations):
            steps.append(_timed_step(planned))
            fixed_steps.append(_timed_step(fixed))
        return Waits(
            wait_s=list(planned.plan_wait_s),
            planning_s=list(planned.planning_s),
            step_s=steps,
            fixed_step_s=fixed_steps,
        )


def lines(waits: Waits, *, command: str) -> list[str]:
    made = [s for s in waits.planning_s if s == s]
    median = statistics.median
    return [
        f"`{command}`",
        "",
        f"- plan wait: median {median(waits.wait_s) * 1e3:.3f} ms (first iteration, planned before it: "
        f"{waits.wait_s[0] * 1e3:.2f} ms); iteration (Trainer.step): median {median(waits.step_s) * 1e3:.1f} ms; "
        f"**wait / iteration {waits.ratio:.3%}**",
        f"- planning (on its thread, while the iteration before runs): median {median(made) * 1e3:.2f} ms "
        f"over {len(made)} plans made; {len(waits.wait_s) - len(made)} iterations ran the last plan",
        f"- the same iterations under {default_hints(chunks=1)[0]} alone: "
        f"median {median(waits.fixed_step_s) * 1e3:.1f} ms "
        f"(planned / fixed: {median(waits.step_s) / median(waits.fixed_step_s):.2f}x)",
    ]
