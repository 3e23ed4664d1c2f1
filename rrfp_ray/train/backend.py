"""Where a `Trainer`'s stages run: the backend protocol, and the one-process backend.

Both backends drive their stages with one `rrfp_ray.runtime.group.StageGroup`.
`LocalBackend` runs every stage as a thread of the caller's process over in-memory
channels (a `rrfp_ray.runtime.local.ThreadFabric`, the group in the caller's process): the same workers, arbiters,
telemetry and orchestration as on Ray, for debugging and tests. The Ray backend (stage actors under a
driver actor that runs the group) is `actors.backend.RayBackend`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from torch import Tensor

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.agreement import TPProtocol
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy
from rrfp_ray.runtime.executor import Executor, Workload
from rrfp_ray.runtime.group import StageGroup
from rrfp_ray.runtime.host import TensorSum
from rrfp_ray.runtime.interval import STAGE_INTERVAL_S, switch_interval
from rrfp_ray.runtime.iteration import measures
from rrfp_ray.runtime.local import ThreadFabric
from rrfp_ray.runtime.mesh import Mesh
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.transport import Channel
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.memory import DataBytes
from rrfp_ray.train.checkpoint import Manifest, StageFile
from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.workload import ModelWorkload


class Backend(Protocol):
    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        """Bring the stages up and give each its share of `workload`."""
        ...

    def set_workload(self, *, workload: ModelWorkload) -> None:
        """Give every stage a fresh workload (another split of the same pipeline too: `Trainer.reshape`); the
        weights start again from the model as given."""
        ...

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap | None = None,
        order: tuple[int, ...] | None = None,
        packing: Packing | None = None,
        data_bytes: DataBytes | None = None,
    ) -> IterationReport:
        """One iteration under `cap` (None: the pipeline's), slot s reading data microbatch `order[s]`, data
        microbatch j made of the samples `packing[j]` (None: the data's own microbatches); with `data_bytes`, a
        `Kx` cap gates admissions by the activation bytes of each data microbatch (`StageGroup.run_iteration`)."""
        ...

    def evaluate(self, *, microbatches: int) -> float:
        """Mean validation loss over the first `microbatches` validation microbatches."""
        ...

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        """Every stage writes its state; returns each stage's file for the manifest."""
        ...

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        """Every stage loads what it holds from `manifest`'s files, whatever pipeline shape wrote them."""
        ...

    def chunk_states(self) -> list[dict[int, dict[str, Tensor]]]:
        """Every stage's (TP shard's, in `Mesh` index order) chunk weights, on the CPU."""
        ...

    def restart(self, *, pipeline: PipelineConfig | None = None, workload: ModelWorkload | None = None) -> None:
        """Tear the stages down (whatever state they are in) and bring fresh ones up with the workload;
        with `pipeline` and its `workload`, at that shape (`rrfp_ray.train.resize`). A cluster that does
        not hold them in time is a `rrfp_ray.errors.PlacementError`."""
        ...

    def can_place(self, *, pipeline: PipelineConfig) -> bool:
        """Whether the cluster holds `pipeline`'s stages now, counting what the running stages hold as
        free (they would make room for it)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class IterationSettings:
    """What every iteration of a running pipeline shares: its cap (None: each call gives one), receive-buffer
    limit, TP protocol and how often its stages measure their layers' costs (0: never; `measures`). Either
    backend runs its iterations through it, from its `PipelineConfig` (`of`)."""

    cap: Cap | None = None
    buffer_limit: int | None = None
    tp_protocol: TPProtocol = TPProtocol.FIRST
    measure_period: int = 0

    @classmethod
    def of(cls, pipeline: PipelineConfig) -> IterationSettings:
        return cls(
            cap=pipeline.cap,
            buffer_limit=pipeline.buffer_limit,
            tp_protocol=pipeline.tp_protocol,
            measure_period=pipeline.balance.measure_period,
        )

    def run(
        self,
        *,
        group: StageGroup,
        iteration: int,
        policy: Policy,
        cap: Cap | None = None,
        order: tuple[int, ...] | None = None,
        packing: Packing | None = None,
        data_bytes: DataBytes | None = None,
    ) -> IterationReport:
        """One iteration of `group` under these settings (`cap` instead of theirs where given)."""
        cap = self.cap if cap is None else cap
        if cap is None:
            raise ValueError("cap: these stages were started without a pipeline's cap, so each iteration needs one")
        return group.run_iteration(
            iteration=iteration,
            policy=policy,
            cap=cap,
            buffer_limit=self.buffer_limit,
            tp_protocol=self.tp_protocol,
            order=order,
            packing=packing,
            measure=measures(iteration=iteration, period=self.measure_period),
            data_bytes=data_bytes,
        )


class LocalBackend:
    """The in-process backend: every stage (every TP rank of it, in every replica) a thread of this process,
    the `StageGroup` (`group`) over a `ThreadFabric` (`fabric`). A `Trainer` starts it with its pipeline and
    workload (`start`); tests, benchmarks and debugging may start it over a bare layout instead (`over`), with
    the executors given per iteration (`run_iteration(executors=...)`) or by a workload (`set_workload`).
    An iteration runs with the process's switch interval at `switch_interval_s` (None: as it is), so the stage
    threads do not wait long for the interpreter's lock (`rrfp_ray.runtime.interval`)."""

    def __init__(self, *, switch_interval_s: float | None = STAGE_INTERVAL_S) -> None:
        if switch_interval_s is not None and not switch_interval_s > 0:
            raise ValueError(f"switch_interval_s must be > 0 (or None: as it is), got {switch_interval_s!r}")
        self.switch_interval_s = switch_interval_s
        self.group: StageGroup | None = None
        self._fabric: ThreadFabric | None = None
        self._settings = IterationSettings()

    @classmethod
    def over(
        cls,
        *,
        layout: Layout,
        timeout_s: float = 60.0,
        link_timeout_s: float = 600.0,
        tp: int = 1,
        k: int = 4,
        wrap: Callable[[int, Channel], Channel] | None = None,
        dp: DPSpec | None = None,
        ties: tuple[tuple[int, ...], ...] = (),
        settings: IterationSettings = IterationSettings(),
    ) -> LocalBackend:
        """Started over `layout` with no workload. `k`: ops each TP rank offers per agreement round;
        `wrap(rank, channel)` wraps every inbound channel of TP rank `rank` (tests delay receives with it);
        `ties`: the stages of each tied weight."""
        backend = cls()
        backend._bring_up(
            layout=layout,
            mesh=Mesh(stages=layout.stages, tp=tp, dp=1 if dp is None else dp.size, ties=ties),
            timeout_s=timeout_s,
            link_timeout_s=link_timeout_s,
            k=k,
            wrap=wrap,
            dp=dp,
            settings=settings,
        )
        return backend

    @property
    def fabric(self) -> ThreadFabric:
        self._running()
        assert self._fabric is not None  # set with the group
        return self._fabric

    @property
    def mesh(self) -> Mesh:
        return self._running().mesh

    @property
    def executors(self) -> list[Executor]:
        """One per actor, in mesh order; replaced (tests do), each actor runs its new one from the next call on."""
        return [handle.host.executor for handle in self.fabric.handles]

    @executors.setter
    def executors(self, executors: Sequence[Executor]) -> None:
        handles = self.fabric.handles
        if len(executors) != len(handles):
            raise ValueError(f"executors: need {len(handles)} (dp x stages x tp), got {len(executors)}")
        for handle, executor in zip(handles, executors):
            handle.host.executor = executor

    def tp_all_reduce(self, *, stage: int, rank: int) -> TensorSum:
        """The sum over the TP ranks of `stage` as rank `rank` calls it (for executors given directly)."""
        return self.fabric.tp_sum(self.mesh.index(stage=stage, rank=rank))

    def start(self, *, pipeline: PipelineConfig, workload: ModelWorkload) -> None:
        if self.group is not None:
            raise RuntimeError("this LocalBackend has already started; use one backend per Trainer")
        self._bring_up(
            layout=pipeline.layout,
            mesh=Mesh(
                stages=pipeline.stages,
                tp=pipeline.tp,
                dp=pipeline.dp,
                ties=tuple(dict.fromkeys(tie.stages for tie in workload.ties)),
            ),
            timeout_s=pipeline.timeout_s,
            link_timeout_s=pipeline.link_timeout_s,
            dp=pipeline.dp_spec,
            settings=IterationSettings.of(pipeline),
        )
        try:
            self.set_workload(workload=workload)
        except BaseException:
            self.close()
            raise

    def set_workload(self, *, workload: Workload) -> None:
        self._running().set_workload(workload=workload)

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap | None = None,
        order: tuple[int, ...] | None = None,
        packing: Packing | None = None,
        data_bytes: DataBytes | None = None,
        executors: Sequence[Executor] | None = None,
        latency: Callable[..., float] | None = None,
    ) -> IterationReport:
        """With `executors` given, every actor runs its own from this iteration on, each message delayed by
        `latency(message, iteration=k)` ms, as `Workload.latency` (None: not at all)."""
        if executors is not None:
            self.executors = executors
            for handle in self.fabric.handles:
                handle.host.latency = latency
        with switch_interval(self.switch_interval_s):
            return self._settings.run(
                group=self._running(),
                iteration=iteration,
                policy=policy,
                cap=cap,
                order=order,
                packing=packing,
                data_bytes=data_bytes,
            )

    def evaluate(self, *, microbatches: int) -> float:
        return self._running().evaluate(microbatches=microbatches)

    def save(self, *, directory: Path, iteration: int) -> dict[int, StageFile]:
        return self._running().save(directory=str(directory), iteration=iteration)

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        self._running().load(directory=str(directory), manifest=manifest)

    def chunk_states(self) -> list[dict[int, dict[str, Tensor]]]:
        return self._running().chunk_states()

    def restart(self, *, pipeline: PipelineConfig | None = None, workload: ModelWorkload | None = None) -> None:
        if pipeline is None:
            self._running().restart()
            return
        if workload is None:
            raise ValueError("restart at another pipeline shape needs that shape's workload")
        self.close()
        self.start(pipeline=pipeline, workload=workload)

    def can_place(self, *, pipeline: PipelineConfig) -> bool:
        return True  # threads of this process: any shape

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = self._fabric = None

    def __enter__(self) -> LocalBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _bring_up(
        self,
        *,
        layout: Layout,
        mesh: Mesh,
        timeout_s: float,
        link_timeout_s: float,
        dp: DPSpec | None,
        settings: IterationSettings,
        k: int = 4,
        wrap: Callable[[int, Channel], Channel] | None = None,
    ) -> None:
        self._fabric = ThreadFabric(
            layout=layout, mesh=mesh, timeout_s=timeout_s, link_timeout_s=link_timeout_s, k=k, wrap=wrap, dp=dp
        )
        self.group = StageGroup(fabric=self._fabric, layout=layout, zero=dp is not None and dp.zero)
        self._settings = settings

    def _running(self) -> StageGroup:
        if self.group is None:
            raise RuntimeError("the LocalBackend is not running: start() it first (a Trainer does), or it was closed")
        return self.group
