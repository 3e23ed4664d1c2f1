"""Planning ahead: iteration k+1 is planned on one background thread while k runs.

`Lookahead.take(iteration=k)` gives k's plan: the one asked for while k-1 ran (`ask`), waited
for at most `PlannerConfig.wait_s`; on an overrun or a failure, the last plan that ran. Every
planner call (plan, observe) runs on the one thread in the order it was asked for, and the
Trainer asks for k+1's plan before it hands k's report to `observe`: so the plan for k+1 sees
the telemetry of iterations <= k-1 exactly, whatever the threads' timing, as `rrfp_ray.plan.loop`
simulates it. A planner restored from a checkpoint holds the plan it made for the iteration the
checkpoint resumes at (`Planner.planned`), so a resumed run plans as one that never stopped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.costs import padded_size
from rrfp_ray.plan.packing import Packing, loads
from rrfp_ray.plan.planner import Planner, measured_bytes
from rrfp_ray.plan.plans import Plan
from rrfp_ray.sim.memory import DataBytes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Seen:
    """What one iteration's data shows the planner, per data microbatch j: `planned`, the largest
    feature over the replicas' microbatch j (every replica runs the one order, so a slot's slowest
    replica is the one to plan for); `observed`, replica 0's, whose ops the telemetry times; `samples`
    (one replica only; None: not shown), per microbatch its samples' features, for packing."""

    planned: list[float]
    observed: list[float]
    samples: list[list[float]] | None = None

    def under(self, packing: Packing | None) -> Seen:
        """What the data shows once packed by `packing` (None: as it is): each microbatch its samples' sum."""
        if packing is None:
            return self
        if self.samples is None:
            raise ValueError("a packed plan needs the samples of the iteration it runs")
        flat = [x for row in self.samples for x in row]
        packed = loads(costs=flat, packing=packing)
        return Seen(planned=packed, observed=packed, samples=[[flat[i] for i in group] for group in packing])


def seen(
    features: Sequence[float],
    *,
    replicas: int,
    microbatches: int,
    samples: Sequence[float] | None = None,
) -> Seen:
    """`features` of D x M microbatches (replica r reads r * M + j) as the planner sees them, with `samples`
    (one replica: its samples' features, microbatch by microbatch, as many to each)."""
    if len(features) != replicas * microbatches:
        raise ValueError(
            f"the data source's features(iteration=...) gave {len(features)} values, expected one per microbatch "
            f"of every replica: dp x microbatches = {replicas} x {microbatches}"
        )
    rows = [[float(x) for x in features[r * microbatches : (r + 1) * microbatches]] for r in range(replicas)]
    grouped = None
    if samples is not None:
        if replicas != 1 or len(samples) % microbatches:
            raise ValueError(
                f"samples: {len(samples)} sample features cannot be grouped into one replica's {microbatches} "
                f"microbatches (dp = {replicas})"
            )
        width = len(samples) // microbatches
        grouped = [[float(x) for x in samples[j * width : (j + 1) * width]] for j in range(microbatches)]
    return Seen(planned=[max(column) for column in zip(*rows)], observed=rows[0], samples=grouped)


@dataclass(frozen=True)
class Taken:
    """The plan an iteration runs: made for `iteration` (an older one for the last plan; None: the identity that
    comes before any), from `seen` (that iteration's data), in `planning_s` (nan: not made here for the iteration
    that runs it), after `wait_s` of waiting for it; `data_bytes`: the bytes its arbiters gate by, as the plan
    was scored (`Planner.data_bytes`; None: counted microbatches, as for a plan not made for the iteration it runs)."""

    plan: Plan
    iteration: int | None
    seen: Seen | None
    planning_s: float = math.nan
    wait_s: float = 0.0
    data_bytes: DataBytes | None = None


class Lookahead:
    """One planner on one thread. `shows(iteration)`: what that iteration's data shows (None: nothing);
    `timeout_s`: the longest a plan not asked for ahead (the first) may take before the last plan runs."""

    def __init__(self, *, planner: Planner, shows: Callable[[int], Seen | None], timeout_s: float) -> None:
        self.planner = planner
        self._shows = shows
        self._timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="planner")
        self._ahead: tuple[int, Future[Taken]] | None = None
        self._ran: Taken | None = None
        self._restored = planner.planned  # a restored planner's last plan was made for this iteration
        self._warned: set[str] = set()

    def take(self, *, iteration: int) -> Taken:
        """`iteration`'s plan, waiting at most `wait_s` for one asked for ahead (`timeout_s` for any other)."""
        started = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        restored, self._restored = self._restored, None
        if restored == iteration:  # nothing is planning yet: the planner is this thread's
            plan, shown = self.planner.last, self._shows(iteration)
            taken = Taken(plan=plan, iteration=iteration, seen=_under(shown, plan), data_bytes=self._bytes(plan, shown))
        elif ahead is not None and ahead[0] == iteration:
            taken = self._result(ahead[1], iteration=iteration, limit_s=self.planner.config.wait_s, started=started)
        else:  # none asked for ahead (the first plan, or another iteration was asked for): plan it now
            if ahead is not None:
                ahead[1].cancel()
            future = self._pool.submit(self._plan, iteration)
            taken = self._result(future, iteration=iteration, limit_s=self._timeout_s, started=started, first=True)
        self._ran = taken
        return taken

    @property
    def ran(self) -> Taken | None:
        """The plan `take` gave last (None: none yet)."""
        return self._ran

    def ahead(self, *, iteration: int) -> Taken | None:
        """The plan asked for `iteration` ahead, without waiting for it (None: not asked, not made yet, or failed)."""
        if self._ahead is None or self._ahead[0] != iteration:
            return None
        future = self._ahead[1]
        if not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result()

    def ask(self, *, iteration: int) -> None:
        """Plan `iteration` in the background, after every observation handed over so far."""
        self._ahead = (iteration, self._pool.submit(self._plan, iteration))

    def observe(self, *, report: IterationReport, taken: Taken) -> None:
        """Feed `report`, run under `taken`, to the planner (in the background, after the plans asked for so far)."""
        self._pool.submit(self._observe, report, taken).add_done_callback(self._logged)

    def settle(self, *, timeout_s: float) -> bool:
        """Wait until every plan and observation asked for is done; False if that took over `timeout_s`."""
        try:
            self._pool.submit(lambda: None).result(timeout=timeout_s)
            return True
        except FutureTimeout:
            return False

    def close(self) -> None:
        """Drop what is still queued; a plan being made finishes on its thread, and nobody takes it."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _plan(self, iteration: int) -> Taken:
        started = time.perf_counter()
        shown = self._shows(iteration)
        plan = self.planner.plan(
            iteration=iteration,
            features=None if shown is None else shown.planned,
            samples=None if shown is None else shown.samples,
        )
        return Taken(
            plan=plan,
            iteration=iteration,
            seen=_under(shown, plan),
            planning_s=time.perf_counter() - started,
            data_bytes=self._bytes(plan, shown),
        )

    def _bytes(self, plan: Plan, shown: Seen | None) -> DataBytes:
        """What the arbiters gate `plan` by on the data `shown` (None: nothing shown) (`Planner.data_bytes`)."""
        if shown is None:
            return self.planner.data_bytes(plan=plan, features=None, samples=None)
        return self.planner.data_bytes(plan=plan, features=shown.planned, samples=shown.samples)

    def _observe(self, report: IterationReport, taken: Taken) -> None:
        shown = taken.seen
        if taken.iteration != report.iteration:  # the last plan ran again, on this iteration's data
            shown = _under(self._shows(report.iteration), taken.plan)
        shape = self.planner.shape
        measured = measured_bytes(report=report, order=taken.plan.order, stages=shape["stages"], chunks=shape["chunks"])
        self.planner.observe(
            report=report,
            plan=taken.plan,
            features=None if shown is None else shown.observed,
            activation_bytes=measured,
            padded=None if shown is None or shown.samples is None else [padded_size(row) for row in shown.samples],
        )

    def _result(
        self, future: Future[Taken], *, iteration: int, limit_s: float, started: float, first: bool = False
    ) -> Taken:
        """The plan `future` makes within `limit_s`, else the last plan (a first plan's errors propagate: what
        the data shows or the planner's configuration is wrong)."""
        try:
            return replace(future.result(timeout=limit_s), wait_s=time.perf_counter() - started)
        except FutureTimeout:
            future.cancel()
            message = "the plan for iteration %d was not ready within %.3f s; running the last plan"
            self._once("overrun", message, iteration, limit_s)
        except Exception as error:
            if first:
                raise
            message = "planning iteration %d failed (%s: %s); running the last plan"
            self._once("failure", message, iteration, type(error).__name__, error)
        if self._ran is not None:  # its bytes were another iteration's: this one's microbatches are counted
            return replace(self._ran, planning_s=math.nan, wait_s=time.perf_counter() - started, data_bytes=None)
        config = self.planner.config
        identity = Plan.identity(microbatches=self.planner.shape["microbatches"], hint=config.hints[0], cap=config.cap)
        return Taken(plan=identity, iteration=None, seen=None, wait_s=time.perf_counter() - started)

    def _once(self, kind: str, message: str, *args: object) -> None:
        """A warning the first time for each `kind`, then at debug level."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, message + " (later ones at debug level)", *args)

    def _logged(self, future: Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None:
            self._once("observe", "the planner could not learn from an iteration (%s: %s)", type(error).__name__, error)


def _under(shown: Seen | None, plan: Plan) -> Seen | None:
    """What `shown` data shows as `plan` packs it."""
    return None if shown is None else shown.under(plan.packing)
