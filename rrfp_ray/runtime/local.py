"""All stages of a pipeline in one process, one thread per stage (per TP rank), over in-memory channels.

Same workers, arbiters and telemetry as on Ray; for tests and debugging.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, TypeVar

from torch import Tensor

from rrfp_ray.observe.telemetry import IterationReport, OpEvent, StageStats, merge_stage_reports
from rrfp_ray.policy.agreement import TPContext, TPProtocol
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.runtime.transport import Channel, local_channels
from rrfp_ray.runtime.worker import Executor, PipelineError, StageWorker
from rrfp_ray.schedule.deps import Layout, Message

T = TypeVar("T")


class LocalPipeline:
    """With `tp` > 1 every stage is `tp` workers, one per TP rank (index `stage * tp + rank`
    in `workers` and in the executors); rank t of a stage talks to rank t of its neighbours,
    and the ranks of a stage agree on every op. `wrap(rank, channel)` wraps every inbound
    channel of TP rank `rank` (tests delay one rank's receives with it)."""

    def __init__(
        self,
        *,
        layout: Layout,
        timeout_s: float = 60.0,
        link_timeout_s: float = 600.0,
        tp: int = 1,
        wrap: Callable[[int, Channel], Channel] | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.layout = layout
        self.timeout_s = timeout_s
        self.tp = tp
        channels = [local_channels(layout=layout, timeout_s=link_timeout_s) for _ in range(tp)]
        self.workers = [
            StageWorker(
                stage=s,
                inbound={
                    link: ch if wrap is None else wrap(t, ch) for link, ch in channels[t].items() if link.dst == s
                },
                outbound={link: ch for link, ch in channels[t].items() if link.src == s},
                timeout_s=timeout_s,
            )
            for s in range(layout.stages)
            for t in range(tp)
        ]
        self._tensor_groups = [ThreadAllGather(parties=tp, timeout_s=timeout_s) for _ in range(layout.stages)]
        self._pool = ThreadPoolExecutor(max_workers=len(self.workers), thread_name_prefix="stage")

    def tp_all_reduce(self, *, stage: int, rank: int) -> Callable[[Tensor], Tensor]:
        """The tensor sum over `stage`'s TP group, as TP rank `rank` calls it (for `rrfp_ray.models.tp`)."""
        return tensor_all_reduce(self._tensor_groups[stage].member(rank))

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap,
        executors: Sequence[Executor],
        buffer_limit: int | None = None,
        latency: Callable[[Message], float] | None = None,
        protocol: TPProtocol = TPProtocol.FIRST,
        k: int = 4,
    ) -> IterationReport:
        """`protocol` and `k`: how TP ranks agree (`rrfp_ray.policy.agreement`); unused without TP."""
        if len(executors) != len(self.workers):
            raise ValueError(f"executors: need {len(self.workers)} (stages x tp), got {len(executors)}")
        layout = Layout(
            stages=self.layout.stages, chunks=self.layout.chunks, microbatches=self.layout.microbatches, split=policy.split
        )
        all_reduce = ThreadAllReduce(parties=len(self.workers), timeout_s=self.timeout_s)
        agree_groups = [ThreadAllGather(parties=self.tp, timeout_s=self.timeout_s) for _ in range(layout.stages)]
        futures = []
        for index, (worker, executor) in enumerate(zip(self.workers, executors)):
            rank = index % self.tp
            tp = None
            if self.tp > 1:
                tp = TPContext(
                    rank=rank,
                    size=self.tp,
                    all_gather=agree_groups[worker.stage].member(rank),
                    all_reduce=self.tp_all_reduce(stage=worker.stage, rank=rank),
                    protocol=protocol,
                    k=k,
                )
            futures.append(
                self._pool.submit(
                    worker.run_iteration,
                    iteration=iteration,
                    layout=layout,
                    policy=policy,
                    cap=cap,
                    executor=executor,
                    buffer_limit=buffer_limit,
                    latency=latency,
                    all_reduce=all_reduce,
                    tp=tp,
                )
            )
        wait(futures)
        failures = [
            f"stage {w.stage}: {f.exception()}" for w, f in zip(self.workers, futures) if f.exception() is not None
        ]
        if failures:
            raise PipelineError(f"iteration {iteration} failed:\n" + "\n".join(failures))
        results: list[tuple[list[OpEvent], StageStats]] = [f.result() for f in futures]
        # TP ranks of a stage run the same actions in the same order: rank 0 reports for its stage
        return merge_stage_reports(iteration=iteration, policy=policy.name, results=results[:: self.tp])

    def close(self) -> None:
        list(self._pool.map(lambda worker: worker.close(), self.workers))
        self._pool.shutdown(wait=True)

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ThreadAllReduce:
    """Sum of one float from each of `parties` threads, returned to all of them."""

    def __init__(self, *, parties: int, timeout_s: float) -> None:
        self._barrier = threading.Barrier(parties, timeout=timeout_s)
        self._lock = threading.Lock()
        self._total = 0.0

    def __call__(self, value: float) -> float:
        with self._lock:
            self._total += value
        self._barrier.wait()
        total = self._total
        if self._barrier.wait() == 0:
            self._total = 0.0
        self._barrier.wait()
        return total


class ThreadAllGather:
    """All-gather among `parties` threads: `member(rank)` is rank's callable; each call returns every rank's value, in rank order."""

    def __init__(self, *, parties: int, timeout_s: float) -> None:
        if parties < 1:
            raise ValueError(f"parties must be >= 1, got {parties}")
        self.parties = parties
        self._barrier = threading.Barrier(parties, timeout=timeout_s)
        self._values: list[Any] = [None] * parties

    def member(self, rank: int) -> Callable[[T], list[T]]:
        if not 0 <= rank < self.parties:
            raise ValueError(f"rank must be in [0, {self.parties}), got {rank}")
        return functools.partial(self._gather, rank=rank)

    def _gather(self, value: T, *, rank: int) -> list[T]:
        self._values[rank] = value
        self._barrier.wait()
        gathered = list(self._values)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read it
        return gathered


def tensor_all_reduce(all_gather: Callable[[Tensor], list[Tensor]]) -> Callable[[Tensor], Tensor]:
    """Sum of a tensor over a group, added in rank order (the same bits on every rank)."""

    def all_reduce(tensor: Tensor) -> Tensor:
        parts = all_gather(tensor)
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    return all_reduce
