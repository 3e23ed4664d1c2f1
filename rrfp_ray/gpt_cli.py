"""jobs/train_gpt.py's flags as a checked `RunConfig`: which flag sets which field, and the checks
that read every input file before any actor starts (errors name the flag)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from rrfp_ray.cli import baseline_policy, config_error, read_text, variability
from rrfp_ray.schedule.validate import read_hint
from rrfp_ray.train.api import workload_fingerprint
from rrfp_ray.train.checkpoint import CheckpointError, resume_point
from rrfp_ray.train.config import RunConfig
from rrfp_ray.train.gpt_workload import corpus_source
from rrfp_ray.train.workload import ModelWorkload

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
    "pipeline.tp_gather": "--tp-gather",
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


def run_config(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    workload_for: Callable[[RunConfig], ModelWorkload],
) -> RunConfig:
    """The run `args` describe, its --data, --hint, --trace and --resume (a checkpoint of `workload_for(run)`)
    read now; bad input exits via `parser`."""
    if args.gpus_per_stage < 0:
        parser.error(f"--gpus-per-stage must be >= 0, got {args.gpus_per_stage:g}")
    if args.gpu and args.gpus_per_stage not in (0, 1):
        parser.error(f"--gpu means --gpus-per-stage 1; it contradicts --gpus-per-stage {args.gpus_per_stage:g}")
    if args.compare and checkpoint_dir(args) is not None:
        parser.error(
            "--compare trains the baseline and then the policy from the same initial weights; a run with checkpoints "
            "(--checkpoint-dir, --checkpoint-every, --resume, --max-restarts) trains one policy: drop one of them"
        )
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
                "hint": _hint(parser, args.hint) if args.hint else None,
                "tp": args.tp,
                "tp_protocol": args.tp_protocol,
                "tp_gather": args.tp_gather,
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
        corpus_source(run).microbatch(iteration=0, index=0)  # reads --data now: a bad path fails before any actor
        if args.trace:
            _read_trace(parser, run)
        if run.train.resume:
            _check_resume(run, workload=workload_for(run))
    except CheckpointError as error:
        parser.error(f"--resume: {str(error).removeprefix('resume: ')}")
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    except ValueError as error:
        parser.error(str(error))
    return run


def baseline_of(run: RunConfig, *, compare: bool) -> str | None:
    """The fixed schedule --compare trains first (`baseline_policy`); None without --compare, when
    the run's policy is that schedule, or with checkpoints (both runs would write them)."""
    baseline = baseline_policy(chunks=run.pipeline.chunks, placement=run.pipeline.layout.placement)
    if not compare or run.pipeline.policy == baseline or run.train.checkpoint_dir is not None:
        return None
    return baseline


def gpus_per_stage(args: argparse.Namespace) -> float:
    return 1.0 if args.gpu else args.gpus_per_stage


def default_out() -> Path:
    """runs/train_gpt for a local run; attached to a cluster (as under `ray job submit`, whose
    working dir is a temporary unpacked copy, unpacked again on every node), a persistent
    directory under the home, named by the start time."""
    if not os.environ.get("RAY_ADDRESS"):
        return Path("runs/train_gpt")
    return Path.home() / "rrfp-runs" / time.strftime("%Y%m%d-%H%M%S")


def checkpoint_dir(args: argparse.Namespace) -> str | None:
    if args.checkpoint_dir is not None:
        return args.checkpoint_dir
    if args.checkpoint_every or args.resume or args.max_restarts:
        return str(Path(args.out) / "checkpoints")
    return None


def _hint(parser: argparse.ArgumentParser, path: str) -> dict:
    try:
        return read_hint(read_text(parser, flag="--hint", path=path))
    except ValueError as error:
        parser.error(f"--hint {path}: {error}")


def _read_trace(parser: argparse.ArgumentParser, run: RunConfig) -> None:
    """Reads --trace now: a truncated or misshapen file fails before any actor starts."""
    try:
        run.variability.trace(pipeline=run.pipeline)
    except (OSError, ValueError, KeyError, TypeError) as error:
        parser.error(f"--trace {run.variability.trace_file}: {error}")


def _check_resume(run: RunConfig, *, workload: ModelWorkload) -> None:
    """A CheckpointError unless the checkpoint directory holds one `workload` can resume from."""
    fingerprint = workload_fingerprint(pipeline=run.pipeline, workload=workload)
    resume_point(directory=Path(run.train.checkpoint_dir), fingerprint=fingerprint)
