"""The multimodal workload on real compute: fixed schedules, readiness and `planned` on the VLM.

Per seed (model init and data), every policy runs from the same initial weights: in-process, each
on a trainer of its own, their timed iterations interleaved (one iteration of each policy in turn,
the turn rotated by the seed and the iteration, so a load that comes and goes on a shared machine
falls on every policy alike; a planned trainer settles its lookahead before the next policy's turn);
on Ray, one trainer runs the policies one after another (`Trainer.reset`), the order rotated by the
seed. Warm-up iterations come first. `planned` runs three ways: arranging the microbatches' order only,
the packing of the samples into microbatches only, or both (`rrfp_ray.plan.planner.Arrangement`);
each fixed schedule runs once more on its iterations' samples packed as the planner packs them
before it has telemetry (`pack` over the samples' images), for the fair comparison. No delay is
injected: an op takes what the model's compute takes, and the images per sample (heavy-tailed)
make the encoder's ops vary.

A policy's cell is the median over seeds of its median iteration makespan (the op schedule, the
optimizer step left out); its ratio is, per seed, the best fixed schedule's median over its own,
geometric mean over the seeds with the lowest and highest. Readiness and `planned` run at the pipeline's
cap (1x), gated in activation bytes once the stages have reported them (`rrfp_ray.train.bytegate`,
`rrfp_ray.plan.planner.Planner.data_bytes`): at most the peak bytes of their fixed reference list on the same
data; the peak activation bytes each measured are printed beside it (over 1F1B's).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from rrfp_ray.cli import count
from rrfp_ray.models.vlm import VLMConfig
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.packing import Packing, pack
from rrfp_ray.plan.planner import HINTS, Arrangement
from rrfp_ray.plan.plans import Plan
from rrfp_ray.plan.scoring import Samples, score
from rrfp_ray.plan.search import search
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.runtime.interval import STAGE_INTERVAL_S
from rrfp_ray.schedule.actions import Kind, parse_action
from rrfp_ray.sim.replay import measured_trace, replay
from rrfp_ray.train.api import Trainer
from rrfp_ray.train.backend import Backend, LocalBackend

FIXED = ("1f1b", "zb-h1")

READINESS = ("bf", "bfw", "cpw")
PLANNED = {f"planned ({a.value})": a for a in Arrangement}  # a row per arrangement
PACKED = {f"{name} packed": name for name in FIXED}  # a fixed schedule on packed microbatches
POLICIES = (*FIXED, *READINESS, *PLANNED, *PACKED)


def add_run_flags(parser: argparse.ArgumentParser, *, iterations_help: str) -> None:
    """The VLM benchmarks' runs: the pipeline, the seeds, the timed and warm-up iterations, and the data."""
    parser.add_argument("--stages", type=count, default=2, help="P (default 2)")
    parser.add_argument("--microbatches", type=count, default=8, help="M (default 8)")
    parser.add_argument("--seeds", type=count, default=5, help="seeds S..S+N-1: model init and data (default 5)")
    parser.add_argument("--first-seed", type=int, default=0, help="S, the first seed (default 0: a long run split)")
    parser.add_argument("--iterations", type=count, default=10, help=iterations_help)
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations before them (default 2)")
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=1e3 * STAGE_INTERVAL_S,
        help="the switch interval the stage threads run with: how long a thread may hold the interpreter's lock "
        f"while another waits (default {1e3 * STAGE_INTERVAL_S:g}, the in-process backend's; CPython's is 5)",
    )
    parser.add_argument("--ray", action="store_true", help="one Ray actor a stage (default: threads of this process)")
    add_data_flags(parser)


def run_configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[VLMConfig, list[RunConfig]]:
    """The model and one run per seed from `add_run_flags`' flags; a bad value exits through `parser.error`."""
    if args.warmup < 0 or args.image_tail < 0 or args.first_seed < 0:
        parser.error("arguments --warmup, --image-tail and --first-seed must be >= 0")
    if not args.switch_interval_ms > 0:
        parser.error(f"argument --switch-interval-ms: must be > 0, got {args.switch_interval_ms:g}")
    if args.ray and args.switch_interval_ms != parser.get_default("switch_interval_ms"):
        parser.error("argument --switch-interval-ms: the stage actors keep their own; it applies in-process only")
    try:
        model = VLMConfig(max_images=args.max_images, image_size=args.image_size)
        return model, [
            RunConfig(
                model={"n_layer": model.n_layer, "n_head": model.n_head, "n_embd": model.n_embd},
                pipeline={"stages": args.stages, "microbatches": args.microbatches, "cap": "1x", "timeout_s": 300},
                train={"micro_batch_size": args.micro_batch_size, "seed": seed},
            )
            for seed in range(args.first_seed, args.first_seed + args.seeds)
        ]
    except ValidationError as error:
        parser.error("; ".join(e["msg"] for e in error.errors()))


def backend(args: argparse.Namespace) -> Backend:
    """A trainer's backend: with `--ray` one Ray actor a stage (Ray started by `start_fabric`), else stage threads of
    this process at `--switch-interval-ms`."""
    if args.ray:
        from actors.backend import RayBackend

        return RayBackend()
    return LocalBackend(switch_interval_s=args.switch_interval_ms / 1e3)


def start_fabric(args: argparse.Namespace, *, trainers: int) -> str:
    """Ready what `backend` needs for `trainers` trainers at a time, and say where their stages run: with `--ray`,
    Ray (attached, or embedded with a logical CPU for each of their stage actors); else `torch.set_num_threads(1)`,
    as each stage actor runs."""
    if args.ray:
        from actors.local_ray import start_ray

        print(start_ray(num_cpus=max(2, trainers * args.stages)))
        return f"{args.stages} stage actors"
    import torch

    torch.set_num_threads(1)
    return f"{args.stages} stage threads of one process"


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    """The VLM benchmarks' data: samples a microbatch, and the images' count per sample, tail and size."""
    parser.add_argument(
        "--micro-batch-size", type=count, default=2, help="samples per microbatch (default 2, as a VLM's pipeline runs)"
    )
    parser.add_argument("--max-images", type=int, default=8, help="most images a sample holds (default 8)")
    parser.add_argument(
        "--image-tail", type=float, default=1.5, help="P(n images) ~ (n + 1) ** -tail (default 1.5: half text-only)"
    )
    parser.add_argument(
        "--image-size", type=int, default=48, help="pixels a side of an image (default 48: 144 patches of 4 pixels)"
    )


def features_packing(trainer: Trainer) -> Packing:
    """The next iteration's samples packed by their features (images) into the pipeline's D x M microbatches."""
    costs = trainer.workload.data.sample_features(iteration=trainer.iteration)
    return pack(costs=costs, bins=trainer.pipeline.global_microbatches)


def step(trainer: Trainer, name: str) -> IterationReport:
    """One iteration of the row `name`."""
    if name in PLANNED:
        return trainer.step(policy="planned", arrange=PLANNED[name])
    if name in PACKED:
        return trainer.step(policy=PACKED[name], packing=features_packing(trainer))
    return trainer.step(policy=name)


@dataclass
class PolicyRuns:
    """What one policy measured over the seeds: per seed, its timed iterations' reports."""

    reports: list[list[IterationReport]] = field(default_factory=list)
    planning_s: list[float] = field(default_factory=list)  # planned only: the seconds each plan took

    def medians(self) -> list[float]:
        return [statistics.median(r.schedule_ms for r in seed) for seed in self.reports]

    def peak_bytes(self) -> float:
        return statistics.median(max(s.peak_bytes for s in r.stages) for seed in self.reports for r in seed)


def run_seed(*, trainer: Trainer, seed: int, warmup: int, iterations: int, runs: Mapping[str, PolicyRuns]) -> None:
    """Every policy on `trainer` (one seed), in an order rotated by the seed."""
    names = list(runs)
    for name in names[seed % len(names) :] + names[: seed % len(names)]:
        trainer.reset()
        trainer.planning_s.clear()
        for _ in range(warmup):
            step(trainer, name)
        runs[name].reports.append([step(trainer, name) for _ in range(iterations)])
        runs[name].planning_s += trainer.planning_s[warmup:]


def run_interleaved(
    *, trainers: Mapping[str, Trainer], seed: int, warmup: int, iterations: int, runs: Mapping[str, PolicyRuns]
) -> None:
    """Every policy on its own trainer (one seed, the same initial weights): warm-ups, then one timed iteration of
    each policy in turn, the turn rotated by the seed and the iteration."""
    names = list(trainers)
    for name in names:
        trainers[name].planning_s.clear()
        for _ in range(warmup):
            settled(trainers[name], step(trainers[name], name))
    reports: dict[str, list[IterationReport]] = {name: [] for name in names}
    for i in range(iterations):
        turn = (seed + i) % len(names)
        for name in names[turn:] + names[:turn]:
            reports[name].append(settled(trainers[name], step(trainers[name], name)))
    for name in names:
        runs[name].reports.append(reports[name])
        runs[name].planning_s += trainers[name].planning_s[warmup:]


def settled(trainer: Trainer, report: IterationReport) -> IterationReport:
    """`report`, once the plan the trainer's lookahead is making has been made (its CPU is the policy's own)."""
    if trainer.planner_state() is None and trainer.planner is not None:
        raise TimeoutError(f"the planner did not settle within {trainer.pipeline.timeout_s} s")
    return report


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean, lowest, highest."""
    return math.exp(statistics.fmean(math.log(v) for v in values)), min(values), max(values)


def ratios(runs: Mapping[str, PolicyRuns], name: str) -> list[float]:
    """Per seed: the best fixed schedule's median makespan over `name`'s."""
    fixed = [runs[f].medians() for f in FIXED]
    return [min(f[s] for f in fixed) / m for s, m in enumerate(runs[name].medians())]


def encoder_spread(runs: PolicyRuns) -> float:
    """P95 / P5 of stage 0's forward op times (where the images are encoded), over every iteration."""
    times = sorted(
        e.end_ms - e.start_ms
        for seed in runs.reports
        for r in seed
        for e in r.events
        if e.stage == 0 and parse_action(e.action, stages=len(r.stages)).kind is Kind.F
    )
    return _quantile(times, 0.95) / _quantile(times, 0.05)


def op_medians(runs: PolicyRuns) -> dict[str, float]:
    """Median ms of each (stage, op kind) over the policy's iterations, keyed like "1B" (stage 1's full backwards)."""
    times: dict[str, list[float]] = {}
    for seed in runs.reports:
        for r in seed:
            for e in r.events:
                kind = parse_action(e.action, stages=len(r.stages)).kind.value
                times.setdefault(f"{e.stage}{kind}", []).append(e.end_ms - e.start_ms)
    return {key: statistics.median(values) for key, values in sorted(times.items())}


def replay_ratio(runs: PolicyRuns, *, trainer: Trainer) -> float | None:
    """Median simulated / measured makespan of the policy's iterations replayed on their own measured trace."""
    pipeline = trainer.pipeline
    ratios = []
    for seed in runs.reports:
        for report in seed:
            policy = make_policy(
                name=report.policy, stages=pipeline.stages, chunks=pipeline.chunks, microbatches=pipeline.microbatches
            )
            ratios.append(replay(report, policy=policy, layout=pipeline.layout, cap=pipeline.cap).ratio)
    return statistics.median(ratios) if ratios else None


def ceiling(runs: Mapping[str, PolicyRuns], *, trainer: Trainer, simulations: int = 600) -> list[float]:
    """Per seed: what planning could win with the true durations. Each timed iteration's measured op times, under
    1f1b (a full backward) and zb-h1 (a split one) on the same data, are one exact prediction; the best plan for
    it (`search` over every order and hint, `simulations` simulated iterations) against the better of the two fixed
    schedules, both simulated on those traces: the best fixed median over the oracle's median (one chunk a stage)."""
    pipeline = trainer.pipeline
    shape = {"stages": pipeline.stages, "chunks": pipeline.chunks, "microbatches": pipeline.microbatches}
    full, split = (make_policy(name=name, **shape) for name in FIXED)
    identity = tuple(range(pipeline.microbatches))
    fixed = [Plan(order=identity, hint=name, cap=pipeline.cap) for name in FIXED]
    out = []
    for full_seed, split_seed in zip(runs[FIXED[0]].reports, runs[FIXED[1]].reports):
        best, oracle = {name: [] for name in FIXED}, []
        for a, b in zip(full_seed, split_seed):
            if a.iteration != b.iteration:
                raise ValueError(f"iteration {a.iteration} under {FIXED[0]} met {b.iteration} under {FIXED[1]}")
            traces = Samples(
                [measured_trace(b, layout=split.layout_over(pipeline.layout))],
                unsplit=[measured_trace(a, layout=full.layout_over(pipeline.layout))],
            )
            for name, ms in zip(FIXED, score(plans=fixed, samples=traces)):
                best[name].append(ms)
            found = search(samples=traces, hints=HINTS, cap=pipeline.cap, simulations=simulations, seed=a.iteration)
            oracle.append(found.score_ms)
        out.append(min(statistics.median(v) for v in best.values()) / statistics.median(oracle))
    return out


def table(runs: Mapping[str, PolicyRuns], *, trainer: Trainer) -> list[str]:
    """Markdown: a row per policy."""
    head = ["policy", "median ms", "over the best fixed", "peak bytes / 1F1B's", "replayed / measured"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = runs["1f1b"].peak_bytes()
    for name, policy_runs in runs.items():
        g, low, high = spread(ratios(runs, name))
        played = replay_ratio(policy_runs, trainer=trainer)
        cells = [
            name,
            f"{statistics.median(policy_runs.medians()):.1f}",
            f"{g:.3f}x ({low:.3f}-{high:.3f})",
            f"{policy_runs.peak_bytes() / base:.2f}",
            "-" if played is None else f"{played:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def best_readiness(runs: Mapping[str, PolicyRuns]) -> str:
    return max(READINESS, key=lambda name: spread(ratios(runs, name))[0])


def best_of(runs: Mapping[str, PolicyRuns], names: Sequence[str]) -> str:
    """The row among `names` with the highest geometric-mean ratio over the best fixed schedule."""
    return max(names, key=lambda name: spread(ratios(runs, name))[0])


def _quantile(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]
