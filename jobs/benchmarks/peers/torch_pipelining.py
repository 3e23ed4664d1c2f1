"""PyTorch's own pipeline schedules timed on a duration trace, next to the makespan of their order:
`measure_all` (and `measure` for one), what `jobs/bench_peers.py` and the results suite's peers part run.

The schedules run one after another in the same P processes (torch.multiprocessing spawn, gloo
on 127.0.0.1, one thread each). Each runs ``torch.distributed.pipelining``: one ``PipelineStage``
per virtual stage the rank holds (looped: ``vs = chunk * P + rank``; V: ``rank`` and ``2P-1-rank``),
each a ``SleepStage`` that sleeps the trace's F / B / W
times (``sleep_module`` says how the sleeps land in PyTorch's passes and how message latency is
modelled). Every timed ``schedule.step`` follows a barrier; its time is the pipeline's makespan,
from the first rank's start to the last rank's end on the machine's monotonic clock.

The ideal is the simulated makespan (``rrfp_ray.sim.simulator``, no memory cap, no transport cost)
of the order PyTorch executed, as the sleeps logged it, on the same trace. The measured time
cannot be below it: every op sleeps at least its trace time after what it depends on.
``order_matches`` says whether that order is our schedule of the same name for the same P, v, M.
Two runtime rules of PyTorch leave it unchanged: DualPipeV's overlapped F and B run as the F then
the B, as our import of its order has them; and virtual stage 0's input gradient runs inside its
weight pass (there is no input gradient to send), where every schedule here has that W right
after its I.

Schedules (`PEERS`): gpipe (ScheduleGPipe), 1f1b (Schedule1F1B), interleaved
(ScheduleInterleaved1F1B, v >= 2), zb-h1 (ScheduleInterleavedZeroBubble, v = 1), zb-interleaved
(the same with v >= 2), zbv (ScheduleZBVZeroBubble, V placement, v = 2) and dualpipev
(ScheduleDualPipeV, V placement, v = 2).
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import pipelining

from benchmarks.peers.sleep_module import SleepStage, microbatch_inputs, stage_costs
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.cpu import Meter, OpClock, idle_rate, per_op_us
from rrfp_ray.schedule.actions import Action, Placement, parse_action
from rrfp_ray.schedule.generators import Chunks, lookup
from rrfp_ray.schedule.validate import Hint
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.trace import Trace


@dataclass(frozen=True)
class Peer:
    pytorch_class: str  # in torch.distributed.pipelining
    ours: str  # our schedule of the same name
    chunks: Chunks  # the chunk counts v it runs with here
    multi: bool  # takes the list of a rank's stages; else its one stage

    @property
    def split(self) -> bool:
        """Backward split into input (I) and weight (W) gradients."""
        return lookup(self.ours).splits

    @property
    def placement(self) -> Placement:
        return lookup(self.ours).placement


PEERS: dict[str, Peer] = {
    "gpipe": Peer(pytorch_class="ScheduleGPipe", ours="gpipe", chunks=Chunks.ONE, multi=False),
    "1f1b": Peer(pytorch_class="Schedule1F1B", ours="1f1b", chunks=Chunks.ONE, multi=False),
    "interleaved": Peer(pytorch_class="ScheduleInterleaved1F1B", ours="interleaved", chunks=Chunks.MANY, multi=True),
    "zb-h1": Peer(pytorch_class="ScheduleInterleavedZeroBubble", ours="zb-h1", chunks=Chunks.ONE, multi=True),
    "zb-interleaved": Peer(
        pytorch_class="ScheduleInterleavedZeroBubble", ours="zb-interleaved", chunks=Chunks.MANY, multi=True
    ),
    "zbv": Peer(pytorch_class="ScheduleZBVZeroBubble", ours="zbv", chunks=Chunks.TWO, multi=True),
    "dualpipev": Peer(pytorch_class="ScheduleDualPipeV", ours="dualpipev", chunks=Chunks.TWO, multi=True),
}
KEYS = (
    "schedule",
    "pytorch_class",
    "stages",
    "chunks",
    "microbatches",
    "iterations",
    "runs_ms",
    "measured_ms",
    "rank0_ms",
    "ideal_ms",
    "ratio",
    "order_matches",
)


@dataclass(frozen=True)
class _Job:
    schedules: tuple[str, ...]
    trace: Trace
    iterations: int
    warmup: int
    payload_elems: int
    port: int
    timeout_s: float
    out: str
    cpu: bool


def measure(
    *,
    schedule: str,
    trace: Trace,
    iterations: int,
    warmup: int = 1,
    payload_elems: int = 4096,
    timeout_s: float = 300.0,
    cpu: bool = False,
) -> dict[str, Any]:
    """One schedule's figures; see :func:`measure_all`."""
    options = {"warmup": warmup, "payload_elems": payload_elems, "timeout_s": timeout_s, "cpu": cpu}
    return measure_all(schedules=[schedule], trace=trace, iterations=iterations, **options)[schedule]


def measure_all(
    *,
    schedules: Sequence[str],
    trace: Trace,
    iterations: int,
    warmup: int = 1,
    payload_elems: int = 4096,
    timeout_s: float = 300.0,
    cpu: bool = False,
) -> dict[str, dict[str, Any]]:
    """Run PyTorch's ``schedules`` on ``trace``, in P = trace.stages processes started once.

    Per schedule, a dict with KEYS: runs_ms (the makespan of each timed step after ``warmup``
    untimed ones), measured_ms (their median), rank0_ms (median of rank 0's own step time),
    ideal_ms (the simulated makespan of the order PyTorch ran), ratio (measured / ideal) and
    order_matches (that order is our schedule's). ``timeout_s`` bounds
    every wait of a rank on another. With ``cpu``, also cpu_per_rank: each rank's CPU per op over
    the timed steps (`rrfp_ray.runtime.cpu.per_op_us`: its process's CPU clock less the idle
    baseline, measured before the first schedule, and the passes' own sleeps and copies).
    """
    if isinstance(schedules, str) or not schedules:
        raise ValueError(f"schedules must be a non-empty list of names, got {schedules!r}")
    if len(set(schedules)) != len(schedules):
        raise ValueError(f"schedules has repeats: {list(schedules)}")
    ours = {name: our_order(schedule=name, trace=trace) for name in schedules}
    for name, value, low in (("iterations", iterations, 1), ("warmup", warmup, 0), ("payload_elems", payload_elems, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    with tempfile.TemporaryDirectory(prefix="rrfp-peer-") as tmp:
        job = _Job(
            schedules=tuple(schedules),
            trace=trace,
            iterations=iterations,
            warmup=warmup,
            payload_elems=payload_elems,
            port=_free_port(),
            timeout_s=timeout_s,
            out=str(Path(tmp) / "result.json"),
            cpu=cpu,
        )
        _launch(job)
        raw = json.loads(Path(job.out).read_text())
    return {name: _figures(name, raw=raw[name], ours=ours[name], trace=trace) for name in schedules}


def our_order(*, schedule: str, trace: Trace) -> dict[int, list[Action]]:
    """Our order for the schedule, or ValueError if it cannot run on the trace
    (what jobs/bench_peers.py checks before any process starts)."""
    if schedule not in PEERS:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(PEERS)}")
    peer = PEERS[schedule]
    if not peer.chunks.allows(trace.chunks):
        raise ValueError(f"trace has chunks={trace.chunks}; schedule {schedule!r} needs chunks {peer.chunks.value}")
    shape = {"stages": trace.stages, "chunks": trace.chunks, "microbatches": trace.microbatches}
    return make_policy(name=peer.ours, **shape).order


def _figures(schedule: str, *, raw: dict[str, Any], ours: dict[int, list[Action]], trace: Trace) -> dict[str, Any]:
    placement = PEERS[schedule].placement
    ran = {
        int(stage): [parse_action(a, stages=trace.stages, placement=placement) for a in actions]
        for stage, actions in raw["order"].items()
    }
    shape = {"stages": trace.stages, "chunks": trace.chunks, "microbatches": trace.microbatches}
    hint = Hint(order=ran, placement=placement)
    ideal = simulate(policy=make_policy(name="hint", **shape, hint=hint), trace=trace, cap=Cap.parse("inf")).makespan_ms
    runs = [1000 * (max(ends) - min(starts)) for starts, ends in raw["times"]]
    measured = statistics.median(runs)
    cpu = {"cpu_per_rank": [per_op_us([uses]) for uses in raw["cpu"]]} if raw["cpu"] else {}
    return {
        "schedule": schedule,
        "pytorch_class": PEERS[schedule].pytorch_class,
        **shape,
        "iterations": len(runs),
        "runs_ms": runs,
        "measured_ms": measured,
        "rank0_ms": statistics.median(1000 * (ends[0] - starts[0]) for starts, ends in raw["times"]),
        "ideal_ms": ideal,
        "ratio": measured / ideal,
        "order_matches": ours == ran,
        **cpu,
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(job: _Job) -> None:
    """Start the P ranks and wait; on any failure, timeout or interrupt no rank is left running."""
    context = mp.start_processes(_worker, args=(job,), nprocs=job.trace.stages, join=False, start_method="spawn")
    limit = 60 + job.timeout_s  # ranks time out on each other first; this catches a stuck start
    deadline = time.monotonic() + limit
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"PyTorch ranks ({', '.join(job.schedules)}) still running after {limit:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join()


def _worker(rank: int, job: _Job) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{job.port}",
        rank=rank,
        world_size=job.trace.stages,
        timeout=timedelta(seconds=job.timeout_s),
    )
    try:
        idle = idle_rate() if job.cpu else None
        mine = {name: _run(name, rank=rank, job=job, idle=idle) for name in job.schedules}
        gathered: list[Any] = [None] * job.trace.stages
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            Path(job.out).write_text(json.dumps({name: _merge(name, gathered) for name in job.schedules}))
    finally:
        dist.destroy_process_group()


def _run(schedule: str, *, rank: int, job: _Job, idle: float | None) -> dict[str, Any]:
    """This rank's (start, end) of every timed step, the order its last step ran in and, with an
    `idle` baseline (CPU s per wall s), the CPU of every timed step (`CpuUse.to_dict()`)."""
    trace, peer = job.trace, PEERS[schedule]
    log: list[tuple[str, int, int]] = []
    op_clock = OpClock()
    held = [peer.placement.virtual_stage(stage=rank, chunk=c, stages=trace.stages) for c in range(trace.chunks)]
    stages = [
        _stage(
            trace=trace,
            virtual_stage=vs,
            placement=peer.placement,
            split=peer.split,
            payload_elems=job.payload_elems,
            log=log,
            op_clock=op_clock,
        )
        for vs in held
    ]
    make: Callable[..., Any] = getattr(pipelining, peer.pytorch_class)
    runner = make(stages if peer.multi else stages[0], n_microbatches=trace.microbatches, loss_fn=_loss)
    batch = microbatch_inputs(microbatches=trace.microbatches, payload_elems=job.payload_elems)
    target = torch.zeros_like(batch)
    times, cpu = [], []
    for i in range(job.warmup + job.iterations):
        log.clear()
        dist.barrier()
        meter, op_clock.cpu_s = Meter(idle=idle or 0.0), 0.0
        start = time.clock_gettime(time.CLOCK_MONOTONIC)  # system-wide on Linux: comparable across ranks
        runner.step(batch, target=target, return_outputs=False)
        if i >= job.warmup:
            times.append((start, time.clock_gettime(time.CLOCK_MONOTONIC)))
            if idle is not None:
                ops = len(_ran(log, split=peer.split))
                cpu.append(meter.stop(ops=ops, op=op_clock, send=(), receive=()).to_dict())
    return {"times": times, "order": _ran(log, split=peer.split), "cpu": cpu}


def _merge(schedule: str, gathered: list[dict[str, Any]]) -> dict[str, Any]:
    """Per timed step, every rank's starts and ends; the order per stage."""
    per_rank = [g[schedule] for g in gathered]
    steps = zip(*(r["times"] for r in per_rank), strict=True)
    return {
        "times": [([start for start, _ in step], [end for _, end in step]) for step in steps],
        "order": {rank: r["order"] for rank, r in enumerate(per_rank)},
        "cpu": [r["cpu"] for r in per_rank] if all(r["cpu"] for r in per_rank) else [],
    }


def _ran(log: list[tuple[str, int, int]], *, split: bool) -> list[str]:
    """The logged sleeps as action texts: a microbatch's first backward sleep on a virtual stage is
    its I with the split (the second its W), else its B (the second is part of that same B)."""
    backwards: Counter[tuple[int, int]] = Counter()
    order = []
    for kind, vs, m in log:
        if kind == "F":
            order.append(f"{vs}F{m}")
            continue
        backwards[vs, m] += 1
        if split:
            order.append(f"{vs}{'I' if backwards[vs, m] == 1 else 'W'}{m}")
        elif backwards[vs, m] == 1:
            order.append(f"{vs}B{m}")
    return order


def _stage(
    *,
    trace: Trace,
    virtual_stage: int,
    placement: Placement,
    split: bool,
    payload_elems: int,
    log: list[tuple[str, int, int]],
    op_clock: OpClock,
) -> pipelining.PipelineStage:
    example = torch.zeros(1, payload_elems, dtype=torch.float64)
    costs = stage_costs(trace=trace, virtual_stage=virtual_stage, placement=placement, split=split)
    module = SleepStage(costs=costs, virtual_stage=virtual_stage, log=log, op_clock=op_clock)
    return pipelining.PipelineStage(
        module,
        stage_index=virtual_stage,
        num_stages=trace.virtual_stages,
        device=torch.device("cpu"),
        input_args=example.clone().requires_grad_(virtual_stage > 0),
        output_args=example.clone().requires_grad_(True),
    )


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output * 0).sum() + (target * 0).sum()
