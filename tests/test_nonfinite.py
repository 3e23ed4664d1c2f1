"""Non-finite gradients: one global decision to skip the step, counted, and training goes on."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from examples.mlp import Regression, mlp
from rrfp_ray import Optim, PipelineConfig, Trainer


@dataclass(frozen=True)
class _InfOnce:
    """Regression data whose microbatch 2 of iteration 1 holds an inf target."""

    microbatches: int = 4

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        x, y = Regression(microbatches=self.microbatches).microbatch(iteration=iteration, index=index)
        if (iteration, index) == (1, 2):
            y = y.clone()
            y[0, 0] = math.inf
        return x, y


def test_an_inf_gradient_skips_the_step_on_every_stage_and_training_continues():
    pipeline = PipelineConfig(stages=3, microbatches=4, policy="bf", timeout_s=30)
    with Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=_InfOnce(),
        pipeline=pipeline,
        optimizer=Optim(lr=1e-2, warmup=0),
    ) as trainer:
        first = trainer.step()
        before = [[p.detach().clone() for p in e.runner.parameters()] for e in trainer.backend.executors]
        bad = trainer.step()
        after = [[p.detach().clone() for p in e.runner.parameters()] for e in trainer.backend.executors]
        third = trainer.step()
    assert not first.skipped_step and not third.skipped_step
    assert bad.skipped_step and all(s.skipped_step for s in bad.stages)
    assert trainer.skipped_steps == 1
    for old, new in zip(before, after):
        assert all(torch.equal(b, a) for b, a in zip(old, new))
    assert math.isfinite(third.loss) and third.loss < first.loss
