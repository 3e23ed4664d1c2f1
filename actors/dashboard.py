"""What a stage shows in the Ray dashboard: op spans on the Ray timeline (recorded when
RAY_PROFILING=1 is in the stage actors' environment: actors.stage_actor.STAGE_ENV) and
per-stage metrics."""

from __future__ import annotations

import torch
from ray._private import profiling  # the only way to add spans to `ray timeline`; our own trace does not need it
from ray.util.metrics import Gauge

from rrfp_ray.observe.telemetry import StageStats
from rrfp_ray.runtime.executor import Executor, ExecutorWrapper
from rrfp_ray.runtime.reduce import GradSink
from rrfp_ray.schedule.actions import Action, Kind

_COLOURS = {Kind.F: "thread_state_running", Kind.I: "rail_response", Kind.B: "rail_response", Kind.W: "good"}


def span_args(*, action: Action, policy: str, iteration: int) -> dict[str, str | int]:
    """What an op's span on the Ray timeline carries (its `args`): which op, of which policy's run and
    iteration, numbers as numbers (Ray stores them as JSON); `name` and `cname` set its label and colour."""
    return {
        "name": str(action),
        "policy": policy,
        "iteration": iteration,
        "stage": action.stage,
        "virtual_stage": action.virtual_stage,
        "microbatch": action.microbatch,
        "cname": _COLOURS[action.kind],
    }


class ProfiledExecutor(ExecutorWrapper):
    """An executor whose every action, in an iteration under `policy`, is a span `2F0` on the Ray timeline
    (category `stage s: F`)."""

    def __init__(self, inner: Executor, *, stage: int, policy: str) -> None:
        super().__init__(inner)
        self.stage = stage
        self.policy = policy

    def run(
        self, *, action: Action, iteration: int, payload: torch.Tensor | None, release: GradSink | None = None
    ) -> torch.Tensor | None:
        extra = span_args(action=action, policy=self.policy, iteration=iteration)
        with profiling.profile(f"stage {self.stage}: {action.kind.value}", extra_data=extra):
            return self.inner.run(action=action, iteration=iteration, payload=payload, release=release)


# What every stage actor exports (Prometheus adds the prefix `ray_`); grafana/rrfp_dashboard.json plots them.
METRICS = {
    "rrfp_iteration_ms": "iteration wall time on this stage",
    "rrfp_blocked_fraction": "share of the iteration with nothing eligible",
    "rrfp_peak_inflight": "most microbatches held between F and B",
    "rrfp_tp_fraction": "share of the iteration spent in TP agreement rounds (0 without TP)",
}


class StageMetrics:
    """Per-stage gauges, served on the node's metrics port (Grafana shows them in the dashboard)."""

    def __init__(self, *, stage: int) -> None:
        self._gauges = {name: Gauge(name, description, tag_keys=("stage",)) for name, description in METRICS.items()}
        for gauge in self._gauges.values():
            gauge.set_default_tags({"stage": str(stage)})

    def record(self, stats: StageStats) -> None:
        share = (lambda ms: ms / stats.wall_ms) if stats.wall_ms else (lambda ms: 0.0)
        self._gauges["rrfp_iteration_ms"].set(stats.wall_ms)
        self._gauges["rrfp_blocked_fraction"].set(share(stats.blocked_ms))
        self._gauges["rrfp_peak_inflight"].set(stats.peak_inflight)
        self._gauges["rrfp_tp_fraction"].set(share(stats.tp_ms))
