"""Train a byte-level GPT through a readiness-driven (RRFP) pipeline on Ray.

Locally (an embedded Ray on this machine, CPU, TCP links), the defaults train a small GPT
on the Python standard library's own sources, first with fixed 1F1B (interleaved with
--chunks > 1, zbv for a V-placed policy) and then with the readiness policy, and print both:

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

from rrfp_ray.installed import require_core

require_core(program="train_gpt.py")  # before the first import of torch or ray

from actors.job_setup import checked_run  # noqa: E402
from actors.local_ray import start_ray  # noqa: E402
from rrfp_ray.cli import add_log_level_flag, add_scenario_flags, configure_logging, write_pictures  # noqa: E402
from rrfp_ray.gpt_cli import baseline_of  # noqa: E402

if TYPE_CHECKING:
    from rrfp_ray.train.api import Trainer
    from rrfp_ray.train.config import RunConfig

DEFAULT_PLACEMENT_S = 600.0  # actors.placement.DEFAULT_TIMEOUT_S, without importing ray for --help


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    parser = build_parser(description=__doc__)
    args = parser.parse_args(argv)
    return args, checked_run(parser, args=args)


def build_parser(*, description: str) -> argparse.ArgumentParser:
    """The job's flags (jobs/train_vlm.py adds its own)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument("--stages", type=int, default=4)
    pipe.add_argument("--chunks", type=int, default=1)
    pipe.add_argument("--microbatches", type=int, default=8)
    pipe.add_argument(
        "--policy",
        default="bf",
        help="a schedule (gpipe, 1f1b, interleaved, looped-bfs, zb-h1, 1f1b-2x, zb-h2, zb-interleaved, zbv, "
        "dualpipev), ready-<schedule>, bf, bfw or cpw",
    )
    pipe.add_argument(
        "--hint",
        default=None,
        help='JSON {stage: ["0F0", ...]} or torch\'s CSV schedule: the order for policies hint / ready-hint',
    )
    pipe.add_argument("--cap", default="2x", help="in-flight cap: 1x/2x of the hint's peak, a count, or inf")
    pipe.add_argument(
        "--backend",
        default="auto",
        help="what carries the links: auto (nccl with CUDA and cupy, else tcp), tcp, gloo or nccl",
    )
    pipe.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (actors) per stage")
    pipe.add_argument("--tp-protocol", default="common", help="TP agreement: first or common")
    pipe.add_argument(
        "--tp-gather", default="tcp", help="what carries the TP agreement's all-gather: tcp or collective"
    )
    pipe.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (--microbatches each)")
    pipe.add_argument("--dp-bucket-mb", type=float, default=25.0, help="MB of gradients per DP all-reduce bucket")
    pipe.add_argument(
        "--no-overlap", action="store_true", help="with --dp: reduce gradients after every stage's last op"
    )
    pipe.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: shard the optimizer state over the --dp replicas (ZeRO-1)",
    )
    pipe.add_argument(
        "--dp-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --dp: train again in this process as one pipeline of dp x microbatches and print the loss difference",
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
        help="Ray resources added to every stage's bundle, aiming stages at a node type: '{\"accelerator_type:A10G\": 0.001}'",
    )
    pipe.add_argument(
        "--placement-timeout",
        type=float,
        default=DEFAULT_PLACEMENT_S,
        help="seconds to wait for the cluster (its autoscaler) to hold every stage",
    )
    pipe.add_argument("--timeout", type=float, default=60.0, help="seconds before a stalled stage is an error")
    pipe.add_argument("--precision", default="fp32", help="fp32, or bf16 (autocast, fp32 master weights, bf16 links)")
    pipe.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each block's internals in its backward"
    )
    model = parser.add_argument_group("model")
    model.add_argument("--n-layer", type=int, default=4)
    model.add_argument("--n-head", type=int, default=4)
    model.add_argument("--n-embd", type=int, default=64)
    model.add_argument("--block-size", type=int, default=64)
    model.add_argument("--untie-embeddings", action="store_true", help="the LM head gets its own weight")
    train = parser.add_argument_group("training")
    train.add_argument("--iterations", type=int, default=30)
    train.add_argument("--micro-batch-size", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=64)
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument(
        "--varlen", action="store_true", help="whole documents of varying length, padding masked out of the loss"
    )
    train.add_argument("--data", default=None, help="text file or directory (default: the Python stdlib's sources)")
    train.add_argument("--val-every", type=int, default=10)
    train.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the fixed baseline first (1f1b; interleaved when --chunks > 1; zbv for a V-placed policy), "
        "same seed and data (default: on, unless the run checkpoints)",
    )
    train.add_argument(
        "--out", default=None, help="output directory (default: runs/train_gpt; on a cluster ~/rrfp-runs/START_TIME)"
    )
    train.add_argument(
        "--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars here (extra: tensorboard)"
    )
    train.add_argument(
        "--checkpoint-dir", default=None, help="checkpoints here (default with --checkpoint-every: OUT/checkpoints)"
    )
    train.add_argument("--checkpoint-every", type=int, default=0, help="iterations between checkpoints (0: none)")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.add_argument(
        "--max-restarts", type=int, default=0, help="rebuild from the last checkpoint after a lost stage"
    )
    add_scenario_flags(parser, default="multimodal")
    add_log_level_flag(parser)
    parser.set_defaults(t_f=10.0)
    return parser


def train(
    *, trainer: Trainer, run: RunConfig, policy: str, out: Path, tensorboard: str | None = None
) -> tuple[dict, list]:
    """`policy` trained to the run's iterations, a line per iteration under a progress bar; its summary and reports."""
    from tqdm import tqdm

    from rrfp_ray.train.gpt_run import PolicyRun, state_lines

    session = PolicyRun(
        trainer=trainer, run=run, policy=policy, telemetry=out / f"telemetry-{policy}.jsonl", tensorboard=tensorboard
    )
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
    from rrfp_ray.train.gpt_workload import gpt_trainer

    return run_job(args=args, run=run, trainer_for=gpt_trainer, program="train_gpt.py")


def run_job(*, args: argparse.Namespace, run: RunConfig, trainer_for: Callable[..., Trainer], program: str) -> dict:
    """Train `run` on Ray (the baseline first, with --compare) and write its outputs; the trainer is
    `trainer_for(run, backend=...)`: the model and data are the only difference between the jobs."""
    from actors.backend import RayBackend
    from actors.capacity import CapacityError
    from rrfp_ray.train.gpt_run import dp_check, dp_check_line, outcome_lines, speedup_vs_baseline

    out = Path(args.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_level = configure_logging(args)
    print(start_ray(num_cpus=max(2, run.pipeline.actors), log_level=log_level))
    print(f"outputs: {out}")
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
        summary, runs = {}, {}
        baseline = baseline_of(run, compare=args.compare is not False)
        if baseline is not None:
            summary["baseline"], runs[baseline] = train(
                trainer=trainer, run=run, policy=baseline, out=out, tensorboard=args.tensorboard
            )
            trainer.reset()  # same initial weights for the second run
        policy = run.pipeline.policy
        result, runs[policy] = train(trainer=trainer, run=run, policy=policy, out=out, tensorboard=args.tensorboard)
        summary |= result
    write_pictures(out=out, runs=runs)
    if baseline is not None:
        summary["speedup_vs_baseline"] = speedup_vs_baseline(summary)
    print("\n" + "\n".join(outcome_lines(summary)))
    if run.pipeline.dp > 1 and args.dp_check:
        summary["dp_check"] = dp_check(run=run, losses=[r.loss for r in runs[policy]], trainer_for=trainer_for)
        print(dp_check_line(run=run, check=summary["dp_check"]))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}/: summary.json, telemetry, Perfetto traces, diagrams ({time.perf_counter() - started:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
