"""Per-iteration scalars for TensorBoard (the optional extra `tensorboard`): loss, validation
loss, iteration time, tokens/s, the bubble and each stage's blocked share.

    log = TensorBoardLog(directory=Path("runs/tb"), run="bf")  # one TensorBoard run per policy
    log.iteration(report, tokens=4096)
"""

from __future__ import annotations

from pathlib import Path

from rrfp_ray.observe.telemetry import IterationReport


class TensorBoardLog:
    def __init__(self, *, directory: Path, run: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._writer = SummaryWriter(log_dir=str(directory / run))

    def iteration(self, report: IterationReport, *, tokens: int) -> None:
        """`tokens`: how many one iteration trains on (for tokens/s)."""
        step, add = report.iteration, self._writer.add_scalar
        if report.loss is not None:
            add("loss/train", report.loss, step)
        add("time/iteration_ms", report.makespan_ms, step)
        add("time/tokens_per_s", tokens / report.makespan_ms * 1e3 if report.makespan_ms else 0.0, step)
        add("pipeline/bubble", report.bubble, step)
        for stats in report.stages:
            add(
                f"pipeline/blocked_stage_{stats.stage}",
                stats.blocked_ms / stats.wall_ms if stats.wall_ms else 0.0,
                step,
            )

    def validation(self, *, iteration: int, loss: float) -> None:
        self._writer.add_scalar("loss/val", loss, iteration)

    def close(self) -> None:
        self._writer.close()
