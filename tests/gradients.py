"""Shared by the gradient-equivalence tests: capture a stage's gradients before its step,
and the unsplit GPT's reference loss and gradients."""

from __future__ import annotations

from torch import Tensor, nn

from rrfp_ray.models.gpt import GPT
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_workload


class GradCapture:
    """Wraps an executor; keeps each parameter's gradient just before the optimizer step: after
    tied gradients are summed over their stages, before a (sum, count) loss's division by the count."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.grads: list[Tensor] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def finish(self, **kwargs):
        runner = self.inner.runner
        norm = runner.grad_sq_norm

        def capture(**norm_kwargs):
            self.grads = [p.grad.clone() for p in runner.parameters()]
            return norm(**norm_kwargs)

        runner.grad_sq_norm = capture
        try:
            return self.inner.finish(**kwargs)
        finally:
            del runner.grad_sq_norm


def gpt_reference(run: RunConfig) -> tuple[float, list[nn.Module]]:
    """The unsplit GPT's mean loss over iteration 0's microbatches, and its layers with gradients."""
    model = GPT(run.model, seed=run.train.seed)
    source = gpt_workload(run).data
    batches = [source.microbatch(iteration=0, index=m) for m in range(run.pipeline.microbatches)]
    loss = sum(model(x, y)[1] for x, y in batches) / len(batches)
    loss.backward()
    return float(loss.detach()), model.layers()
