"""All stages of a pipeline in one process, one thread per stage, over in-memory channels.

Same workers, arbiters and telemetry as on Ray; for tests and debugging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from rrfp_ray.arbiter import Cap
from rrfp_ray.deps import Layout, Message
from rrfp_ray.policy import Policy
from rrfp_ray.telemetry import IterationReport, OpEvent, StageStats, merge_stage_reports
from rrfp_ray.transport import local_channels
from rrfp_ray.worker import Executor, PipelineError, StageWorker


class LocalPipeline:
    def __init__(self, *, layout: Layout, timeout_s: float = 60.0, link_timeout_s: float = 600.0) -> None:
        channels = local_channels(layout=layout, timeout_s=link_timeout_s)
        self.layout = layout
        self.timeout_s = timeout_s
        self.workers = [
            StageWorker(
                stage=s,
                inbound={link: ch for link, ch in channels.items() if link.dst == s},
                outbound={link: ch for link, ch in channels.items() if link.src == s},
                timeout_s=timeout_s,
            )
            for s in range(layout.stages)
        ]
        self._pool = ThreadPoolExecutor(max_workers=layout.stages, thread_name_prefix="stage")

    def run_iteration(
        self,
        *,
        iteration: int,
        policy: Policy,
        cap: Cap,
        executors: Sequence[Executor],
        buffer_limit: int | None = None,
        latency: Callable[[Message], float] | None = None,
    ) -> IterationReport:
        layout = Layout(
            stages=self.layout.stages, chunks=self.layout.chunks, microbatches=self.layout.microbatches, split=policy.split
        )
        all_reduce = ThreadAllReduce(parties=len(self.workers), timeout_s=self.timeout_s)
        futures = [
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
            )
            for worker, executor in zip(self.workers, executors)
        ]
        wait(futures)
        failures = [f"stage {s}: {f.exception()}" for s, f in enumerate(futures) if f.exception() is not None]
        if failures:
            raise PipelineError(f"iteration {iteration} failed:\n" + "\n".join(failures))
        results: list[tuple[list[OpEvent], StageStats]] = [f.result() for f in futures]
        return merge_stage_reports(iteration=iteration, policy=policy.name, results=results)

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
