"""All stages of a pipeline in one process, one thread per stage (per TP rank), over in-memory channels.

Same workers, arbiters, telemetry and orchestration (`rrfp_ray.runtime.group`) as on Ray;
for tests and debugging. `ThreadStages` is the in-process `Fabric`, `ThreadStage` its
`StageHandle`; `LocalPipeline` drives them with executors given per iteration.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.policy.agreement import TPContext, TPProtocol
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.runtime.errors import PipelineError, joint_exit_code
from rrfp_ray.runtime.executor import Executor, Workload
from rrfp_ray.runtime.group import StageGroup, stage_label
from rrfp_ray.runtime.reduce import DPContext, DPSpec, GradReducer
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, ThreadAllReduce, tensor_all_reduce, tensor_reduce_to
from rrfp_ray.runtime.transport import Channel, local_channels
from rrfp_ray.runtime.worker import StageWorker
from rrfp_ray.schedule.deps import Layout, Message
from rrfp_ray.schedule.grad_ready import reduce_order

logger = logging.getLogger(__name__)
_SLACK_S = 5.0  # how much longer than a stage's own timeout the fabric waits for its answer


@dataclass
class _Round:
    """What the workers of one iteration share: the float all-reduce of the optimizer step and
    each stage's TP agreement all-gather (fresh each iteration: a failed one leaves them broken)."""

    all_reduce: ThreadAllReduce
    agree: list[ThreadAllGather]
    joined: set[int] = field(default_factory=set)


class ThreadStage:
    """One stage (one TP rank of it, in one DP replica) as a `StageHandle`: its calls run in order
    on a thread of its own and return futures. `executor` and `latency` are what its workload gave it."""

    def __init__(self, *, index: int, worker: StageWorker, tp: int, stages: ThreadStages) -> None:
        self.index = index
        self.worker = worker
        self.rank = index % tp
        self.replica = index // (tp * stages.layout.stages)
        self.tp = tp
        self.label = stage_label(stage=worker.stage, rank=self.rank, replica=self.replica, tp=tp, dp=stages.dp_size)
        self.executor: Executor | None = None
        self.latency: Callable[[Message], float] | None = None
        self._stages = stages
        self._group = self.replica * stages.layout.stages + worker.stage  # this stage's TP group, in this replica
        self._dp = stages.dp_context(stage=worker.stage, rank=self.rank, replica=self.replica, name=self.label)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self.label)

    def set_workload(self, *, workload: Workload, layout: Layout) -> Future:
        """Built at once in the caller's thread: models built in parallel threads would race for torch's global RNG."""
        done: Future = Future()
        try:
            self._set_workload(workload=workload, layout=layout)
            done.set_result(None)
        except Exception as error:  # reported by the fabric's wait, naming this stage
            done.set_exception(error)
        return done

    def run_iteration(
        self,
        *,
        iteration: int,
        layout: Layout,
        policy: Policy,
        cap: Cap,
        buffer_limit: int | None,
        tp_protocol: TPProtocol,
    ) -> Future:
        shared = self._stages.join_round(self.index)
        tp = None
        if self.tp > 1:
            tp = TPContext(
                rank=self.rank,
                size=self.tp,
                all_gather=shared.agree[self._group].member(self.rank),
                all_reduce=self._stages.tp_all_reduce(stage=self.worker.stage, rank=self.rank, replica=self.replica),
                protocol=tp_protocol,
                k=self._stages.k,
            )
        return self._thread.submit(
            self._run_iteration,
            iteration=iteration,
            layout=layout,
            policy=policy,
            cap=cap,
            buffer_limit=buffer_limit,
            all_reduce=shared.all_reduce,
            tp=tp,
            dp=self._dp,
        )

    def evaluate(self, *, chunk: int, inputs: Future | None, index: int) -> Future:
        def forward() -> Tensor:
            given = None if inputs is None else inputs.result(timeout=self.worker.timeout_s)
            return self._executor().evaluate(chunk=chunk, inputs=given, index=index)

        return self._thread.submit(forward)

    def save(self, *, directory: str, iteration: int) -> Future:
        def save() -> Any:
            return self._executor().save(directory=Path(directory), iteration=iteration, shard=self.index)

        return self._thread.submit(save)

    def load(self, *, directory: str, file: Any) -> Future:
        return self._thread.submit(lambda: self._executor().load(directory=Path(directory), file=file))

    def chunk_states(self) -> Future:
        return self._thread.submit(lambda: self._executor().chunk_states())

    def close(self) -> None:
        self.worker.close()
        if self._dp is not None:
            self._dp.reducer.close()
        self._thread.shutdown(wait=True)

    def _set_workload(self, *, workload: Workload, layout: Layout) -> None:
        if self.tp > 1:
            all_reduce = self._stages.tp_all_reduce(stage=self.worker.stage, rank=self.rank, replica=self.replica)
            workload = workload.with_tp(rank=self.rank, size=self.tp, all_reduce=all_reduce)
        if self._dp is not None:
            workload = workload.with_dp(rank=self.replica, zero_sum=self._dp.zero_sum)
        if getattr(workload, "ties", ()):  # parameters shared between stages (`rrfp_ray.train.ties`)
            reduce = functools.partial(
                self._stages.tie_all_reduce, stage=self.worker.stage, rank=self.rank, replica=self.replica
            )
            workload = workload.with_ties(reduce=reduce)
        self.executor = workload.executor(stage=self.worker.stage, layout=layout)
        self.latency = workload.latency

    def _run_iteration(self, **kwargs: Any) -> Any:
        events, stats = self.worker.run_iteration(executor=self._executor(), latency=self.latency, **kwargs)
        stats.replica = self.replica
        return events, stats

    def _executor(self) -> Executor:
        if self.executor is None:
            raise RuntimeError(f"{self.label}: no workload yet (set_workload first)")
        return self.executor


class ThreadStages:
    """The in-process `Fabric`: with `tp` > 1 every stage is `tp` workers, one per TP rank;
    rank t of a stage talks to rank t of its neighbours; `k`: ops each rank offers per agreement
    round (`TPContext.k`). With `dp`, `dp.size` replicas of all that (index
    `(replica * stages + stage) * tp + rank`), the workers of one (stage, TP rank) summing their
    gradients. `wrap(rank, channel)` wraps every inbound channel of TP rank `rank` (tests delay one
    rank's receives with it)."""

    def __init__(
        self,
        *,
        layout: Layout,
        timeout_s: float = 60.0,
        link_timeout_s: float = 600.0,
        tp: int = 1,
        k: int = 4,
        wrap: Callable[[int, Channel], Channel] | None = None,
        dp: DPSpec | None = None,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.dp = dp
        self.dp_size = 1 if dp is None else dp.size
        self.layout = layout
        self.timeout_s = timeout_s
        self.link_timeout_s = link_timeout_s
        self.tp = tp
        self.k = k
        self.wrap = wrap
        self.handles: list[ThreadStage] = []
        self._tensor_groups: list[ThreadAllGather] = []
        self._dp_groups: list[ThreadAllGather] = []
        self._tie_groups: dict[tuple[tuple[int, ...], int, int], ThreadAllGather] = {}
        self._round: _Round | None = None
        self._lock = threading.Lock()

    def start(self) -> list[ThreadStage]:
        layout, tp, dp = self.layout, self.tp, self.dp_size
        channels = [
            [local_channels(layout=layout, timeout_s=self.link_timeout_s) for _ in range(tp)] for _ in range(dp)
        ]
        wrap = self.wrap or (lambda _, channel: channel)
        workers = [
            StageWorker(
                stage=s,
                inbound={link: wrap(t, ch) for link, ch in channels[d][t].items() if link.dst == s},
                outbound={link: ch for link, ch in channels[d][t].items() if link.src == s},
                timeout_s=self.timeout_s,
            )
            for d in range(dp)
            for s in range(layout.stages)
            for t in range(tp)
        ]
        tp_ranks = [f"TP rank {t}" for t in range(tp)]
        self._tensor_groups = [
            ThreadAllGather(
                parties=tp,
                timeout_s=self.timeout_s,
                name=f"the TP all-reduce of {self._label(s, replica=d)}",
                labels=tp_ranks,
            )
            for d in range(dp)
            for s in range(layout.stages)
        ]
        self._dp_groups = [
            ThreadAllGather(
                parties=dp,
                timeout_s=self.timeout_s,
                name=f"the DP reduction of {self._label(s, rank=t)}",
                labels=[f"replica {d}" for d in range(dp)],
            )
            for s in range(layout.stages)
            for t in range(tp)
        ]
        self._tie_groups = {}  # fresh ones after a restart
        self._round = None
        self.handles = [ThreadStage(index=i, worker=w, tp=tp, stages=self) for i, w in enumerate(workers)]
        logger.info(
            "%d stage threads up (%d replicas x %d stages x %d TP ranks)", len(self.handles), dp, layout.stages, tp
        )
        return list(self.handles)

    def wait(self, pending: list[Future], *, labels: list[str], what: str) -> list:
        timeout_s = self.timeout_s + _SLACK_S
        _, late = wait_all(pending, timeout=timeout_s)
        errors = {
            label: future.exception()
            for future, label in zip(pending, labels)
            if future not in late and future.exception() is not None
        }
        failures = [f"{label} failed during {what}: {_text(error)}" for label, error in errors.items()]
        causes: list[BaseException | None] = list(errors.values())
        if late:  # a stalled stage is named beside the errors its neighbours ran into
            names = ", ".join(label for future, label in zip(pending, labels) if future in late)
            failures.append(f"{what}: no answer within {timeout_s:g} s from {names}")
            causes.append(None)
        if failures:
            raise PipelineError("\n".join(failures), exit_code=joint_exit_code(causes))
        return [future.result() for future in pending]

    def stop(self, *, graceful: bool) -> None:
        """All at once (a worker's receive threads end on its neighbours' STOP); the threads end either
        way: after a failure, on broken links, within their timeout."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.handles))) as pool:
            list(pool.map(ThreadStage.close, self.handles))
        self.handles = []

    def tp_all_reduce(self, *, stage: int, rank: int, replica: int = 0) -> Callable[[Tensor], Tensor]:
        """The tensor sum over `stage`'s TP group, as TP rank `rank` calls it (for `rrfp_ray.models.tp`)."""
        return tensor_all_reduce(self._tensor_groups[replica * self.layout.stages + stage].member(rank))

    def dp_context(self, *, stage: int, rank: int, replica: int, name: str) -> DPContext | None:
        """The gradient reduction of (`stage`, TP `rank`) in `replica`, over its DP group (None without DP)."""
        if self.dp is None:
            return None
        member = self._dp_groups[stage * self.tp + rank].member(replica)
        group_sum = tensor_all_reduce(member)
        reducer = GradReducer(
            all_reduce=group_sum,
            reduce_to=tensor_reduce_to(member, rank=replica) if self.dp.zero else None,
            order=reduce_order(chunks=self.layout.chunks),
            bucket_bytes=self.dp.bucket_bytes,
            timeout_s=self.timeout_s,
            name=name,
        )
        return DPContext(reducer=reducer, overlap=self.dp.overlap, zero_sum=group_sum if self.dp.zero else None)

    def tie_all_reduce(self, stages: tuple[int, ...], tensor: Tensor, *, stage: int, rank: int, replica: int) -> Tensor:
        """The sum of `tensor` over TP rank `rank` of each of `stages` in `replica` (they share a tied parameter)."""
        with self._lock:
            group = self._tie_groups.setdefault(
                (stages, rank, replica),
                ThreadAllGather(
                    parties=len(stages),
                    timeout_s=self.timeout_s,
                    name=f"the tied-weight all-reduce of {self._label(stage, rank=rank, replica=replica)}",
                    labels=[f"stage {s}" for s in stages],
                ),
            )
        return tensor_all_reduce(group.member(stages.index(stage)))(tensor)

    def join_round(self, index: int) -> _Round:
        """The shared objects of the iteration stage `index` is starting: a stage asking again opens the next round."""
        with self._lock:
            if self._round is None or index in self._round.joined:
                parties = len(self.handles)
                self._round = _Round(
                    all_reduce=ThreadAllReduce(parties=parties, timeout_s=self.timeout_s),
                    agree=[
                        ThreadAllGather(
                            parties=self.tp,
                            timeout_s=self.timeout_s,
                            name=f"the TP agreement of {self._label(s, replica=d)}",
                            labels=[f"TP rank {t}" for t in range(self.tp)],
                        )
                        for d in range(self.dp_size)
                        for s in range(self.layout.stages)
                    ],
                )
            self._round.joined.add(index)
            return self._round

    def _label(self, stage: int, *, rank: int | None = None, replica: int | None = None) -> str:
        """A stage, or one TP rank of it, in one replica or (`replica` None) in each."""
        tp, dp = (1 if rank is None else self.tp), (1 if replica is None else self.dp_size)
        return stage_label(stage=stage, rank=rank or 0, replica=replica or 0, tp=tp, dp=dp)


class LocalPipeline:
    """A `StageGroup` over `ThreadStages`, driven with executors given per iteration (index
    `(replica * stages + stage) * tp + rank`): for tests, benchmarks in one process and debugging."""

    def __init__(
        self,
        *,
        layout: Layout,
        timeout_s: float = 60.0,
        link_timeout_s: float = 600.0,
        tp: int = 1,
        k: int = 4,
        wrap: Callable[[int, Channel], Channel] | None = None,
        dp: DPSpec | None = None,
    ) -> None:
        self.layout = layout
        self.tp = tp
        self.stages = ThreadStages(
            layout=layout, timeout_s=timeout_s, link_timeout_s=link_timeout_s, tp=tp, k=k, wrap=wrap, dp=dp
        )
        self.group = StageGroup(fabric=self.stages, layout=layout, tp=tp, dp=self.stages.dp_size)

    def tp_all_reduce(self, *, stage: int, rank: int) -> Callable[[Tensor], Tensor]:
        return self.stages.tp_all_reduce(stage=stage, rank=rank)

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
    ) -> IterationReport:
        """`protocol`: how TP ranks agree (`rrfp_ray.policy.agreement`); unused without TP."""
        handles = self.stages.handles
        if len(executors) != len(handles):
            raise ValueError(f"executors: need {len(handles)} (dp x stages x tp), got {len(executors)}")
        for handle, executor in zip(handles, executors):
            handle.executor, handle.latency = executor, latency
        return self.group.run_iteration(
            iteration=iteration, policy=policy, cap=cap, buffer_limit=buffer_limit, tp_protocol=protocol
        )

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _text(error: BaseException | None) -> str:
    return str(error) or type(error).__name__
