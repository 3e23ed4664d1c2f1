"""The results suite's measured parts, for `jobs/bench_suite.py`: the Ray runtime at P=4 (runtime),
PP=2 x TP=2 under each TP agreement protocol (tp), and PyTorch's own schedules on the same traces
(peers, in jobs/benchmarks/peers/torch_pipelining.py); each keeps what it measured when a driver fails.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.rows import Agreement, TPRow
from benchmarks.suite import Run, Scenario, figures, where
from rrfp_ray.observe.telemetry import IterationReport, tp_summary
from rrfp_ray.policy.caps import Cap
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.sim.simulator import simulate

log = logging.getLogger(__name__)

Case = tuple[Scenario, int]  # a scenario and the seed of its trace

PEER_GROUPS = ((("1f1b", "zb-h1"), 1), (("interleaved", "zbv", "dualpipev"), 2))
TP = 2
TP_SCENARIOS = ("lognormal-0.3", "comm", "multimodal+comm")
TP_RANK_COMM = ("comm", "multimodal+comm")  # each TP rank's messages take their own latencies


@dataclass
class RayPart:
    """A part measured on Ray: per driver and scenario a warm-up and then timed iterations of every
    run; what its drivers measured stays when one of them fails."""

    warmup: int
    iterations: int
    rows: list[dict] = field(default_factory=list)
    startup_s: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    next_iteration: int = 0  # numbers the iterations of all its drivers

    def drive(
        self, *, name: str, pipeline: Any, group: Sequence[Run], workloads: Sequence[tuple[Case, Any]]
    ) -> Iterator[tuple[Case, dict[str, list]]]:
        """One driver for `pipeline` over the cases (scenario, seed), each with its workload, the runs
        taking turns; yields each case's timed reports by run. A failure ends it, in `errors`."""
        import ray

        from actors.driver import PipelineDriver
        from actors.teardown import end_actors

        driver = PipelineDriver.remote(pipeline=pipeline, workload=workloads[0][1])
        try:
            self.startup_s[name] = ray.get(driver.startup_seconds.remote())
            for case, workload in workloads:
                ray.get(driver.set_workload.remote(workload=workload))
                rounds = self.warmup + self.iterations
                runs = {run.label: (pipeline.resolved_policy(run.policy), run.arbiter_cap) for run in group}
                turns = driver.take_turns.remote(runs=runs, rounds=rounds, first_iteration=self.next_iteration)
                reports = ray.get(turns)  # the group in the driver runs them, taking turns against drift
                self.next_iteration += rounds * len(runs)
                yield case, {label: runs[self.warmup :] for label, runs in reports.items()}
            ray.get(driver.shutdown.remote())
            end_actors([driver], timeout_s=30.0)  # exits after its last call, so Ray records that call as finished
        except Exception as error:  # keep what was measured; the report says what failed
            self.errors.append(f"{name}: {type(error).__name__}: {error}")
            log.warning("driver %s failed: %s", name, error)
        finally:
            ray.kill(driver)

    def section(self) -> dict[str, Any]:
        return {"rows": self.rows, "startup_s": self.startup_s, "errors": self.errors}


def runtime_part(
    *,
    scenarios: Sequence[Scenario],
    runs: Sequence[Run],
    stages: int,
    microbatches: int,
    seeds: Sequence[int],
    warmup: int,
    iterations: int,
) -> dict[str, Any]:
    """Per scenario, seed and run: measured iteration times on Ray, and the simulator's for the same trace."""
    import ray

    from actors.local_ray import start_ray
    from rrfp_ray.runtime.synthetic import SyntheticWorkload
    from rrfp_ray.train.config import PipelineConfig

    log.info(start_ray(num_cpus=max(2, stages)))
    cases = [(spec, seed) for spec in scenarios for seed in seeds]
    traces = {
        (spec.label, seed): spec.traces(stages=stages, microbatches=microbatches, seed=seed) for spec, seed in cases
    }
    part = RayPart(warmup=warmup, iterations=iterations)
    try:
        for (chunks, placement), group in by_layout(runs=runs, stages=stages, microbatches=microbatches).items():
            pipeline = PipelineConfig(
                stages=stages, chunks=chunks, microbatches=microbatches, policy=group[0].policy, timeout_s=120.0
            )
            workloads = [(case, SyntheticWorkload(trace=traces[case[0].label, case[1]][chunks])) for case in cases]
            name = f"P={stages} v={chunks} {placement.value}"
            drives = part.drive(name=name, pipeline=pipeline, group=group, workloads=workloads)
            for (spec, seed), reports in drives:
                trace = traces[spec.label, seed][chunks]
                for run in group:
                    policy = pipeline.resolved_policy(run.policy)
                    predicted = simulate(
                        policy=policy, trace=trace, cap=run.arbiter_cap, buffer_limit=pipeline.buffer_limit
                    )
                    cells = [figures(report=r, policy=policy, trace=trace) for r in reports[run.label]]
                    measured_ms = statistics.median(c.makespan_ms for c in cells)
                    memory_x = max(c.memory_x for c in cells)
                    part.rows.append(
                        {
                            **where(spec, run, stages=stages, microbatches=microbatches),
                            "seed": seed,
                            "runs_ms": [c.makespan_ms for c in cells],
                            "step_ms": statistics.median(r.step_ms for r in reports[run.label]),
                            "measured_ms": measured_ms,
                            "sim_ms": predicted.makespan_ms,
                            "blocked_fraction": statistics.median(c.blocked_fraction for c in cells),
                            "peak_inflight": max(c.peak_inflight for c in cells),
                            "memory_x": memory_x,
                        }
                    )
                    log.info(
                        f"runtime P={stages} {spec.label:>16} seed {seed} {run.label:<12} {measured_ms:8.1f} ms "
                        f"(sim {predicted.makespan_ms:8.1f}, memory {memory_x:.2f}x)"
                    )
    finally:
        ray.shutdown()
    return part.section()


def by_layout(*, runs: Sequence[Run], stages: int, microbatches: int) -> dict[tuple[int, Placement], list[Run]]:
    """The runs grouped by what a pipeline's stages are built for (chunks and placement), in that order."""
    groups: dict[tuple[int, Placement], list[Run]] = {}
    for run in runs:
        placement = run.make(stages=stages, microbatches=microbatches).placement
        groups.setdefault((run.chunks, placement), []).append(run)
    return dict(sorted(groups.items(), key=lambda item: (item[0][0], item[0][1].value)))


TP_RUNS = (Run("1f1b", 1, None), Run("bf", 1, Cap.parse("2x")), Run("bfw", 1, Cap.parse("2x")))


def tp_workload(*, spec: Scenario, tp: int, stages: int, microbatches: int) -> Any:
    """Every rank computes the seed-0 trace; under TP on the comm scenarios rank t's messages
    take the latencies of the trace drawn with seed t (rank 0's are the seed-0 trace's)."""
    from rrfp_ray.runtime.synthetic import SyntheticWorkload

    traces = tuple(spec.traces(stages=stages, microbatches=microbatches, seed=t)[1] for t in range(tp))
    return SyntheticWorkload(trace=traces[0], rank_comm=traces if tp > 1 and spec.label in TP_RANK_COMM else ())


def tp_figures(*, reports: Sequence[IterationReport]) -> dict[str, Any]:
    """What the timed iterations of one run show (`tp_summary`: rank 0 of each stage), and ops per
    iteration over the stages."""
    return {
        "runs_ms": [r.makespan_ms for r in reports],
        "measured_ms": statistics.median(r.makespan_ms for r in reports),
        **tp_summary(list(reports)),
        "ops": len(reports[0].events),
    }


def tp_part(
    *, scenarios: Sequence[Scenario], stages: int, microbatches: int, warmup: int, iterations: int
) -> dict[str, Any]:
    """Per scenario, run and TP agreement protocol: measured iteration times on Ray and what the
    agreement cost; protocol tp1 is the same pipeline without TP, the baseline of vs_tp1."""
    import ray

    from actors.local_ray import start_ray
    from rrfp_ray.train.config import PipelineConfig

    log.info(start_ray(num_cpus=stages * TP))
    part = RayPart(warmup=warmup, iterations=iterations)
    try:
        for protocol in Agreement:
            tp, agreement = (1, {}) if protocol is Agreement.TP1 else (TP, {"tp_protocol": protocol.value})
            pipeline = PipelineConfig(
                stages=stages, microbatches=microbatches, policy=TP_RUNS[0].policy, timeout_s=120.0, tp=tp, **agreement
            )
            shape = {"tp": tp, "stages": stages, "microbatches": microbatches}
            workloads = [((spec, 0), tp_workload(spec=spec, **shape)) for spec in scenarios]
            for (spec, _), reports in part.drive(name=protocol, pipeline=pipeline, group=TP_RUNS, workloads=workloads):
                for run in TP_RUNS:
                    row = {
                        **where(spec, run, stages=stages, microbatches=microbatches),
                        "tp": tp,
                        "protocol": protocol.value,
                        **tp_figures(reports=reports[run.label]),
                    }
                    part.rows.append(row)
                    read = TPRow.of(row)
                    log.info(
                        f"tp {spec.label:>16} {run.label:<7} {protocol.value:<6} {read.measured_ms:8.1f} ms, "
                        f"coordination {read.tp_coord_fraction:.2%} over {read.tp_rounds:.0f} rounds "
                        f"({read.tp_ms_per_round:.3f} ms each)"
                    )
    finally:
        ray.shutdown()
    rows = [TPRow.of(row) for row in part.rows]
    baseline = {(r.scenario, r.run): r.measured_ms for r in rows if r.protocol is Agreement.TP1}
    for row, read in zip(part.rows, rows):
        tp1_ms = baseline.get((read.scenario, read.run))
        row["vs_tp1"] = read.measured_ms / tp1_ms if tp1_ms else None
    return part.section()


def peers_part(
    *, scenarios: Sequence[Scenario], stages: int, microbatches: int, seeds: Sequence[int], warmup: int, iterations: int
) -> dict[str, Any]:
    """Per scenario and seed, PyTorch's schedules in their groups (v=1, v=2, V) on that trace; what failed
    is in `errors`."""
    from benchmarks.peers.torch_pipelining import measure_all

    rows, errors = [], []
    keep = ("pytorch_class", "runs_ms", "measured_ms", "ideal_ms", "ratio", "order_matches")
    for spec, seed in ((spec, seed) for spec in scenarios for seed in seeds):
        traces = spec.traces(stages=stages, microbatches=microbatches, seed=seed)
        for schedules, chunks in PEER_GROUPS:
            try:
                results = measure_all(
                    schedules=list(schedules), trace=traces[chunks], iterations=iterations, warmup=warmup
                )
            except Exception as error:  # keep what was measured; the report says what failed
                errors.append(
                    f"P={stages} {spec.label} seed {seed} {','.join(schedules)}: {type(error).__name__}: {error}"
                )
                log.warning("peers %s %s failed: %s", spec.label, schedules, error)
                continue
            for name, r in results.items():
                shape = {"stages": stages, "microbatches": microbatches, "seed": seed, "chunks": chunks}
                rows.append({"scenario": spec.label, "schedule": name, **shape, **{k: r[k] for k in keep}})
                log.info(
                    f"peers P={stages} {spec.label:>16} seed {seed} {name:<12} {r['measured_ms']:8.1f} ms "
                    f"(ideal {r['ideal_ms']:8.1f})"
                )
    return {"rows": rows, "errors": errors}
