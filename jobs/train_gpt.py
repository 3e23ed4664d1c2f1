"""Train a byte-level GPT through a readiness-driven (RRFP) pipeline on Ray.

Locally (an embedded Ray on this machine, CPU, gloo links), the defaults train a small GPT
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
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from actors.local_ray import start_ray
from rrfp_ray.cli import (
    add_log_level_flag,
    add_scenario_flags,
    baseline_policy,
    config_error,
    configure_logging,
    read_text,
    variability,
    writable_dir,
    write_pictures,
)
from rrfp_ray.schedule.validate import read_hint
from rrfp_ray.train.checkpoint import CheckpointError

if TYPE_CHECKING:
    from rrfp_ray.train.config import RunConfig

FLAGS = {
    "pipeline.stages": "--stages",
    "pipeline.chunks": "--chunks",
    "pipeline.microbatches": "--microbatches",
    "pipeline.policy": "--policy",
    "pipeline.cap": "--cap",
    "pipeline.backend": "--backend",
    "pipeline.timeout_s": "--timeout",
    "pipeline.hint": "--hint",
    "pipeline.tp": "--tp",
    "pipeline.tp_protocol": "--tp-protocol",
    "pipeline.dp": "--dp",
    "pipeline.dp_bucket_mb": "--dp-bucket-mb",
    "pipeline.zero": "--zero",
    "pipeline.precision": "--precision",
    "pipeline.activation_checkpointing": "--activation-checkpointing",
    "train.varlen": "--varlen",
    "model.tie_embeddings": "--untie-embeddings",
    "train.iterations": "--iterations",
    "train.micro_batch_size": "--micro-batch-size",
    "train.seq_len": "--seq-len",
    "train.seed": "--seed",
    "train.lr": "--lr",
    "train.data": "--data",
    "train.val_every": "--val-every",
    "train.checkpoint_dir": "--checkpoint-dir",
    "train.checkpoint_every": "--checkpoint-every",
    "train.resume": "--resume",
    "train.max_restarts": "--max-restarts",
    "model.n_layer": "--n-layer",
    "model.n_head": "--n-head",
    "model.n_embd": "--n-embd",
    "model.block_size": "--block-size",
    "variability.scenario": "--scenario",
    "variability.t_f": "--t-f",
    "variability.params": "scenario parameters",
}


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig]:
    from rrfp_ray.train.config import RunConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    pipe.add_argument("--stages", type=int, default=4)
    pipe.add_argument("--chunks", type=int, default=1)
    pipe.add_argument("--microbatches", type=int, default=8)
    pipe.add_argument(
        "--policy",
        default="bf",
        help="a schedule (gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-interleaved, zbv, dualpipev), "
        "ready-<schedule>, bf, bfw or cpw",
    )
    pipe.add_argument("--hint", default=None, help="JSON {stage: [\"0F0\", ...]} or torch's CSV schedule: the order for policies hint / ready-hint")
    pipe.add_argument("--cap", default="2x", help="in-flight cap: 1x/2x of the hint's peak, a count, or inf")
    pipe.add_argument("--backend", default="auto", help="auto, gloo or nccl")
    pipe.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (actors) per stage")
    pipe.add_argument("--tp-protocol", default="common", help="TP agreement: first or common")
    pipe.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the pipeline (--microbatches each)")
    pipe.add_argument("--dp-bucket-mb", type=float, default=25.0, help="MB of gradients per DP all-reduce bucket")
    pipe.add_argument("--no-overlap", action="store_true", help="with --dp: reduce gradients after every stage's last op")
    pipe.add_argument(
        "--zero", type=int, default=0, choices=(0, 1), help="1: shard the optimizer state over the --dp replicas (ZeRO-1)"
    )
    pipe.add_argument(
        "--dp-check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --dp: train again in this process as one pipeline of dp x microbatches and print the loss difference",
    )
    pipe.add_argument("--gpu", action="store_true", help="one GPU per stage actor (same as --gpus-per-stage 1)")
    pipe.add_argument(
        "--gpus-per-stage", type=float, default=0.0, help="GPUs per stage actor; a fraction shares one GPU (gloo links)"
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
        default=True,
        help="run the fixed baseline first (1f1b; interleaved when --chunks > 1; zbv for a V-placed policy), "
        "same seed and data (not with checkpoints)",
    )
    train.add_argument("--out", default="runs/train_gpt", help="output directory")
    train.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard scalars here (extra: tensorboard)")
    train.add_argument("--checkpoint-dir", default=None, help="checkpoints here (default with --checkpoint-every: OUT/checkpoints)")
    train.add_argument("--checkpoint-every", type=int, default=0, help="iterations between checkpoints (0: none)")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.add_argument("--max-restarts", type=int, default=0, help="rebuild from the last checkpoint after a lost stage")
    add_scenario_flags(parser, default="multimodal")
    add_log_level_flag(parser)
    parser.set_defaults(t_f=10.0)
    args = parser.parse_args(argv)
    if args.gpus_per_stage < 0:
        parser.error(f"--gpus-per-stage must be >= 0, got {args.gpus_per_stage:g}")
    if args.gpu and args.gpus_per_stage not in (0, 1):
        parser.error(f"--gpu means --gpus-per-stage 1; it contradicts --gpus-per-stage {args.gpus_per_stage:g}")
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package: pip install 'rrfp-ray[tensorboard]'")
    try:
        run = RunConfig(
            model={
                "n_layer": args.n_layer,
                "n_head": args.n_head,
                "n_embd": args.n_embd,
                "block_size": args.block_size,
                "tie_embeddings": not args.untie_embeddings,
            },
            pipeline={
                "stages": args.stages,
                "chunks": args.chunks,
                "microbatches": args.microbatches,
                "policy": args.policy,
                "cap": args.cap,
                "backend": args.backend,
                "timeout_s": args.timeout,
                "hint": hint(parser, args.hint) if args.hint else None,
                "tp": args.tp,
                "tp_protocol": args.tp_protocol,
                "dp": args.dp,
                "dp_bucket_mb": args.dp_bucket_mb,
                "dp_overlap": not args.no_overlap,
                "zero": args.zero,
                "precision": args.precision,
                "activation_checkpointing": args.activation_checkpointing,
            },
            variability=variability(args),
            train={
                "iterations": args.iterations,
                "micro_batch_size": args.micro_batch_size,
                "seq_len": args.seq_len,
                "lr": args.lr,
                "seed": args.seed,
                "data": args.data,
                "val_every": args.val_every,
                "checkpoint_dir": checkpoint_dir(args),
                "checkpoint_every": args.checkpoint_every,
                "resume": args.resume,
                "max_restarts": args.max_restarts,
                "varlen": args.varlen,
                "device": "cuda" if gpus_per_stage(args) else "cpu",
            },
        )
        from rrfp_ray.train.gpt_workload import corpus_source

        corpus_source(run).microbatch(iteration=0, index=0)  # reads --data now: a bad path fails before any actor
        if args.trace:
            trace_of(parser, run)
        if run.train.resume:
            check_resume(run)
    except CheckpointError as error:
        parser.error(f"--resume: {str(error).removeprefix('resume: ')}")
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    except ValueError as error:
        parser.error(str(error))
    check_local_devices(parser, args=args, run=run)
    writable_dir(parser, flag="--out", path=args.out)
    return args, run


def hint(parser: argparse.ArgumentParser, path: str) -> dict:
    try:
        return read_hint(read_text(parser, flag="--hint", path=path))
    except ValueError as error:
        parser.error(f"--hint {path}: {error}")


def trace_of(parser: argparse.ArgumentParser, run: RunConfig) -> None:
    """Reads --trace now: a truncated or misshapen file fails before any actor starts."""
    try:
        run.variability.trace(pipeline=run.pipeline)
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--trace {run.variability.trace_file}: {error}")


def check_local_devices(parser: argparse.ArgumentParser, *, args: argparse.Namespace, run: RunConfig) -> None:
    """Without a cluster to attach to, the stages run on this machine: NCCL links and GPUs must be here."""
    from actors.local_ray import attaching
    from rrfp_ray.runtime.transport import LinkBackend

    if attaching():
        return  # the cluster's nodes hold the GPUs; placement waits for them
    where = "this run would start a local Ray here (set RAY_ADDRESS to run on a cluster)"
    if run.pipeline.backend is LinkBackend.NCCL:
        from actors.collective import nccl_missing

        missing = nccl_missing()
        if missing is not None:
            parser.error(f"--backend nccl: {missing}; {where}")
    if gpus_per_stage(args):
        import torch

        if not torch.cuda.is_available():
            flag = "--gpu" if args.gpu else f"--gpus-per-stage {args.gpus_per_stage:g}"
            parser.error(f"{flag}: no CUDA device is visible (torch.cuda.is_available() is False); {where}")


def check_resume(run: RunConfig) -> None:
    """A CheckpointError, before Ray starts, unless the checkpoint directory holds one this run can resume from."""
    from rrfp_ray.train.api import workload_fingerprint
    from rrfp_ray.train.checkpoint import resume_point
    from rrfp_ray.train.gpt_workload import gpt_workload

    fingerprint = workload_fingerprint(pipeline=run.pipeline, workload=gpt_workload(run))
    resume_point(directory=Path(run.train.checkpoint_dir), fingerprint=fingerprint)


def gpus_per_stage(args: argparse.Namespace) -> float:
    return 1.0 if args.gpu else args.gpus_per_stage


def checkpoint_dir(args: argparse.Namespace) -> str | None:
    if args.checkpoint_dir is not None:
        return args.checkpoint_dir
    if args.checkpoint_every or args.resume or args.max_restarts:
        return str(Path(args.out) / "checkpoints")
    return None


def train(
    *, trainer, run, policy_name: str, out: Path, label: str, tensorboard: str | None = None
) -> tuple[dict, list]:
    """Train to run.train.iterations (from wherever the trainer is: a resumed run starts later)."""
    from tqdm import tqdm

    from rrfp_ray.observe.telemetry import append_jsonl
    from rrfp_ray.train.gpt_workload import corpus_source

    board = None
    if tensorboard:
        from rrfp_ray.observe.tensorboard import TensorBoardLog

        board = TensorBoardLog(directory=Path(tensorboard), run=policy_name)

    source = corpus_source(run)  # tokens/s counts real tokens: with --varlen, padding is left out
    reports, val_loss, tokens_seen = [], None, []
    telemetry = out / f"telemetry-{policy_name}.jsonl"
    telemetry.unlink(missing_ok=True)
    bar = tqdm(total=run.train.iterations, initial=trainer.iteration, desc=label, disable=None, leave=False)
    while trainer.iteration < run.train.iterations:
        iteration = trainer.iteration
        report = trainer.step(policy=policy_name)
        reports.append(report)
        append_jsonl(path=telemetry, report=report)
        tokens = source.tokens(iteration=iteration)
        tokens_seen.append(tokens)
        if board is not None:
            board.iteration(report, tokens=tokens)
        line = (
            f"[{label}] iter {iteration:3d}  loss {report.loss:.4f}  {report.makespan_ms:7.1f} ms "
            f"(step {report.step_ms:4.1f})  "
            f"{tokens / report.makespan_ms * 1e3:8.0f} tok/s  bubble {report.bubble:5.1%}  "
            f"blocked {report.blocked_fraction:5.1%}"
        )
        if run.pipeline.tp > 1:
            line += f"  TP agreement {report.tp_fraction:4.2%}"
        if report.restart:
            line += f"  (first after restart {report.restart})"
        if report.skipped_step:
            line += "  step skipped (non-finite gradients)"
        every = run.train.val_every
        if every and (trainer.iteration % every == 0 or trainer.iteration == run.train.iterations):
            val_loss = trainer.evaluate()
            line += f"  val {val_loss:.4f}"
            if board is not None:
                board.validation(iteration=iteration, loss=val_loss)
        bar.write(line)
        bar.update()
    bar.close()
    if board is not None:
        board.close()
    median_ms = statistics.median(r.makespan_ms for r in reports)
    summary = {
        "policy": policy_name,
        "iterations": run.train.iterations,
        "loss_first": reports[0].loss,
        "loss_last": reports[-1].loss,
        "val_loss_last": val_loss,
        "iteration_ms_median": median_ms,  # optimizer step included
        "step_ms_median": statistics.median(r.step_ms for r in reports),
        "tokens_per_s": sum(tokens_seen) / sum(r.makespan_ms for r in reports) * 1e3,  # real tokens (no padding)
        "peak_inflight": max(r.peak_inflight for r in reports),
        "restarts": trainer.restarts,
        "skipped_steps": sum(r.skipped_step for r in reports),
        "precision": run.pipeline.precision.value,
        "varlen": run.train.varlen,
    }
    if run.pipeline.tp > 1:
        summary["tp_coord_fraction"] = statistics.median(r.tp_fraction for r in reports)
    if run.pipeline.dp > 1:
        summary["optim_bytes_per_actor"] = max(s.optim_bytes for r in reports for s in r.stages)  # ZeRO-1: about 1/D
        print(f"[{label}] optimizer state per actor: at most {summary['optim_bytes_per_actor'] / 2**20:.2f} MiB")
    return summary, reports


def dp_check(*, run, losses: list[float]) -> dict:
    """Train the same iterations as one pipeline of dp x microbatches in this process; print how far the losses differ."""
    from rrfp_ray.train.gpt_workload import gpt_trainer

    pipeline = run.pipeline.model_copy(update={"dp": 1, "zero": 0, "microbatches": run.pipeline.global_microbatches})
    quiet = run.variability.model_copy(update={"scenario": "none", "trace_file": None})  # no injected delays
    reference = run.model_copy(update={"pipeline": pipeline, "variability": quiet})
    with gpt_trainer(reference) as trainer:
        expected = [r.loss for r in trainer.fit(len(losses))]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    print(
        f"dp check: dp={run.pipeline.dp} x microbatches={run.pipeline.microbatches} against one pipeline of "
        f"{pipeline.microbatches} microbatches (in-process), {len(losses)} iterations: largest relative loss "
        f"difference {worst:.2e} ({'equal' if worst < 1e-4 else 'DIFFERENT'} within 1e-4)"
    )
    return {"iterations": len(losses), "max_rel_loss_diff": worst, "reference_losses": expected}


def main(argv: list[str] | None = None) -> dict:
    args, run = parse(argv)
    from actors.backend import RayBackend
    from rrfp_ray.train.gpt_workload import gpt_trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_level = configure_logging(args)
    print(start_ray(num_cpus=max(2, run.pipeline.actors), log_level=log_level))
    started = time.perf_counter()
    with gpt_trainer(run, backend=RayBackend(gpus_per_stage=gpus_per_stage(args))) as trainer:
        print(f"{run.pipeline.actors} stage actors up in {trainer.backend.startup_s:.1f} s")
        summary, runs = {}, {}
        baseline = baseline_policy(chunks=run.pipeline.chunks, placement=run.pipeline.layout.placement)
        compare = args.compare and run.pipeline.policy != baseline and run.train.checkpoint_dir is None
        if compare:
            summary["baseline"], runs[baseline] = train(
                trainer=trainer, run=run, policy_name=baseline, out=out, label=baseline, tensorboard=args.tensorboard
            )
            trainer.reset()  # same initial weights for the second run
        policy = run.pipeline.policy
        result, runs[policy] = train(
            trainer=trainer, run=run, policy_name=policy, out=out, label=policy, tensorboard=args.tensorboard
        )
        summary |= result
    write_pictures(out=out, runs=runs)
    print(
        f"\n{result['policy']}: loss {result['loss_first']:.3f} -> {result['loss_last']:.3f} "
        f"(val {result['val_loss_last'] or float('nan'):.3f}), median iteration {result['iteration_ms_median']:.1f} ms, "
        f"{result['tokens_per_s']:.0f} tokens/s"
    )
    if "baseline" in summary:
        base = summary["baseline"]
        summary["speedup_vs_baseline"] = base["iteration_ms_median"] / result["iteration_ms_median"]
        print(
            f"{base['policy']}: loss {base['loss_first']:.3f} -> {base['loss_last']:.3f}, median iteration "
            f"{base['iteration_ms_median']:.1f} ms\nspeedup of {result['policy']} over fixed {base['policy']}: "
            f"{summary['speedup_vs_baseline']:.2f}x"
        )
    if run.pipeline.dp > 1 and args.dp_check:
        summary["dp_check"] = dp_check(run=run, losses=[r.loss for r in runs[policy]])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}/: summary.json, telemetry, Perfetto traces, diagrams ({time.perf_counter() - started:.0f} s)")
    return summary


if __name__ == "__main__":
    main()
