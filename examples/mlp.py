"""A small MLP on synthetic regression data, pipelined over 2 stages.

python examples/mlp.py          # every stage a thread of this process
python examples/mlp.py --ray    # every stage a Ray actor (starts a local Ray)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rrfp_ray import PipelineConfig, Trainer

FEATURES = 16


@dataclass(frozen=True)
class Regression:
    """y = sin(x @ w) + noise for one fixed random w; each microbatch is seeded by (stream, iteration, index)."""

    microbatches: int
    stream: int = 0  # 0: training samples, 1: validation samples
    batch_size: int = 32

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        w = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0)) / FEATURES**0.5
        g = torch.Generator().manual_seed((self.stream * 1_000_003 + iteration) * 1_000_003 + index)
        x = torch.randn(self.batch_size, FEATURES, generator=g)
        return x, torch.sin(x @ w) + 0.01 * torch.randn(self.batch_size, 1, generator=g)


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray", action="store_true", help="run the stages as Ray actors")
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("--policy", default="bf")
    args = parser.parse_args(argv)
    backend = None
    if args.ray:
        from actors.backend import RayBackend

        backend = RayBackend()
    pipeline = PipelineConfig(stages=2, microbatches=4, policy=args.policy, timeout_s=30)
    trainer = Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=Regression(microbatches=4),
        val_data=Regression(microbatches=4, stream=1),
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
        pipeline=pipeline,
        backend=backend,
    )
    losses = []
    with trainer:
        for _ in range(args.iterations):
            report = trainer.step()
            losses.append(report.loss)
            if report.iteration % 10 == 0 or report.iteration == args.iterations - 1:
                print(f"iter {report.iteration:3d}  loss {report.loss:.4f}  {report.makespan_ms:6.1f} ms")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation loss {trainer.evaluate():.4f}")
    return losses


if __name__ == "__main__":
    main()
