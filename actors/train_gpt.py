"""Train a byte-level GPT through a readiness-driven (RRFP) pipeline on Ray (`rrfp-train`, or by path:
`python jobs/train_gpt.py`, which `ray job submit` runs).

Locally (an embedded Ray on this machine, CPU, TCP links), the defaults train a small GPT
on the Python standard library's own sources, first with the fixed schedules that hold 1F1B's
activation memory (1f1b and zb-h1; interleaved and zb-interleaved with --chunks > 1, zbv for a
V-placed policy), then with `planned` at that memory (--cap 1x), and print the speedup over the
faster fixed schedule:

    python jobs/train_gpt.py

On a cluster (`ray up cluster.yaml`), from the repo root:

    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_gpt.py --gpu --backend auto

Outputs go to --out DIR: summary.json, telemetry.jsonl (one line per iteration); with
--tensorboard DIR, TensorBoard scalars as well (`tensorboard --logdir DIR`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from actors.job_setup import checked_run
from actors.local_ray import start_ray
from rrfp_ray.cli import add_flags, add_log_level_flag, add_scenario_flags, configure_logging, write_pictures
from rrfp_ray.installed import missing_extra
from rrfp_ray.job import run_job
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_cli import MODEL, PIPELINE, TRAIN, VARIABILITY, baselines_of

if TYPE_CHECKING:
    from rrfp_ray.train.api import Trainer

DEFAULT_PLACEMENT_S = 600.0  # actors.placement.DEFAULT_TIMEOUT_S, without importing ray for --help


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    parser = build_parser(description=__doc__)
    args = parser.parse_args(argv)
    return args, checked_run(parser, args=args)


def build_parser(*, description: str) -> argparse.ArgumentParser:
    """The job's flags (jobs/train_vlm.py adds its own)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    add_flags(pipe, model=RunConfig, flags=PIPELINE)
    pipe.add_argument(
        "--dp-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --dp: train again in this process as one pipeline "
        "of dp x microbatches and print the loss difference",
    )
    pipe.add_argument("--gpu", action="store_true", help="one GPU per stage actor (same as --gpus-per-stage 1)")
    pipe.add_argument(
        "--gpus-per-stage",
        type=float,
        default=0.0,
        help="GPUs per stage actor; a fraction shares one GPU (TCP or gloo links)",
    )
    pipe.add_argument(
        "--stage-resources",
        type=json.loads,
        default={},
        metavar="JSON",
        help="Ray resources added to every stage's bundle, "
        "aiming stages at a node type: '{\"accelerator_type:A10G\": 0.001}'",
    )
    pipe.add_argument(
        "--placement-timeout",
        type=float,
        default=DEFAULT_PLACEMENT_S,
        help="seconds to wait for the cluster (its autoscaler) to hold every stage",
    )
    add_flags(parser.add_argument_group("model"), model=RunConfig, flags=MODEL)
    train = parser.add_argument_group("training")
    add_flags(train, model=RunConfig, flags=TRAIN)
    train.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="train the fixed schedules at 1F1B's activation memory first (1f1b and zb-h1; interleaved and "
        "zb-interleaved when --chunks > 1; zbv for a V-placed policy), each from the same initial weights and data, "
        "and compare the policy with the faster (default: on, unless the run checkpoints)",
    )
    train.add_argument(
        "--out", default=None, help="output directory (default: runs/train_gpt; on a cluster ~/rrfp-runs/START_TIME)"
    )
    train.add_argument(
        "--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars here (extra: tensorboard)"
    )
    add_scenario_flags(parser, flags=VARIABILITY)
    add_log_level_flag(parser)
    return parser


def train(
    *, trainer: Trainer, run: RunConfig, policy: str, out: Path, tensorboard: str | None = None
) -> tuple[dict, list]:
    """`policy` trained to the run's iterations, a line per iteration under a progress bar (with tqdm, the
    `jobs` extra); its summary and reports."""
    from rrfp_ray.recipes.gpt_run import PolicyRun, state_lines

    session = PolicyRun(
        trainer=trainer, run=run, policy=policy, telemetry=out / f"telemetry-{policy}.jsonl", tensorboard=tensorboard
    )
    if missing_extra("tqdm", extra="jobs"):
        for line in session.iterations():
            print(line)
    else:
        from tqdm import tqdm

        with tqdm(total=run.train.iterations, initial=trainer.iteration, desc=policy, disable=None, leave=False) as bar:
            for line in session.iterations():
                bar.write(line)
                bar.update()
    summary = session.summary()
    for line in state_lines(summary):
        print(line)
    return summary, session.reports


def main(argv: list[str] | None = None) -> dict:
    args, run = parse(argv)
    from rrfp_ray.recipes.gpt_workload import gpt_trainer

    return train_on_ray(args=args, run=run, trainer_for=gpt_trainer, program="train_gpt.py")


def train_on_ray(
    *, args: argparse.Namespace, run: RunConfig, trainer_for: Callable[..., Trainer], program: str
) -> dict:
    """Train `run` on Ray (the fixed baselines first, with --compare) and write its outputs; the trainer is
    `trainer_for(run, backend=...)`: the model and data are the only difference between the jobs."""
    from actors.backend import RayBackend
    from actors.capacity import CapacityError
    from rrfp_ray.recipes.gpt_run import compared, dp_check, dp_check_line, outcome_lines

    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_level = configure_logging(args)
    print(start_ray(num_cpus=max(2, run.pipeline.actors), log_level=log_level))
    print(f"outputs: {out}")
    if missing := missing_extra("tqdm", extra="jobs"):
        print(f"progress bars skipped: {missing}")
    started = time.perf_counter()
    backend = RayBackend(
        gpus_per_stage=args.placement.gpus_per_stage,
        stage_resources=args.placement.resources,
        placement_timeout_s=args.placement.timeout_s,
    )
    try:
        trainer = trainer_for(run, backend=backend)
    except CapacityError as error:  # before any actor started
        print(f"{program}: error: --dp/--stages/--tp/--gpus-per-stage/--stage-resources: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    with trainer:
        print(f"{run.pipeline.actors} stage actors up in {trainer.backend.startup_s:.1f} s")
        if trainer.resumed is not None:
            print(trainer.resumed)
        baselines, runs = {}, {}
        for baseline in baselines_of(run, compare=args.compare is not False):
            baselines[baseline], runs[baseline] = train(
                trainer=trainer, run=run, policy=baseline, out=out, tensorboard=args.tensorboard
            )
            trainer.reset()  # the same initial weights for the next run
        policy = run.pipeline.policy
        summary, runs[policy] = train(trainer=trainer, run=run, policy=policy, out=out, tensorboard=args.tensorboard)
    if baselines:
        summary |= compared(summary, baselines=baselines, runs=runs, cap=run.pipeline.cap)
    pair = (summary["baseline"]["policy"], policy) if baselines else None
    diagrams = write_pictures(out=out, runs=runs, pair=pair)
    print("\n" + "\n".join(outcome_lines(summary)))
    if run.pipeline.dp > 1 and args.dp_check:
        summary["dp_check"] = dp_check(run=run, losses=[r.loss for r in runs[policy]], trainer_for=trainer_for)
        print(dp_check_line(run=run, check=summary["dp_check"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    pictures = "Perfetto traces, diagrams" if diagrams else "Perfetto traces"
    print(f"wrote {out}/: summary.json, telemetry, {pictures} ({time.perf_counter() - started:.0f} s)")
    return summary


def command() -> None:
    """The `rrfp-train` command: `main` as every job runs it (`rrfp_ray.job.run_job`)."""
    run_job(main)
