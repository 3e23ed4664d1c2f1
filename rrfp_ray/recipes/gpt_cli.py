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

from rrfp_ray.cli import (
    PIPELINE_FLAGS,
    Flag,
    config_error,
    equal_memory_baselines,
    flag_names,
    flag_values,
    model_flags,
    read_text,
    scenario_flags,
    variability,
)
from rrfp_ray.models.gpt import GPTConfig
from rrfp_ray.recipes.config import RunConfig, TrainConfig
from rrfp_ray.recipes.gpt_workload import corpus_source
from rrfp_ray.schedule.validate import read_hint
from rrfp_ray.train.build import check_global_batch, model_parameters
from rrfp_ray.train.checkpoint import CheckpointError, parameters_fingerprint, resume_point
from rrfp_ray.train.config import PLANNED, PipelineConfig
from rrfp_ray.train.sources import packing_refusal
from rrfp_ray.train.workload import ModelWorkload

PIPELINE = model_flags(
    PipelineConfig,
    prefix="pipeline.",
    without=("buffer_limit", "link_timeout_s"),
    flags=(*PIPELINE_FLAGS, Flag("policy", default=PLANNED), Flag("cap", default="1x")),
)
MODEL = model_flags(
    GPTConfig,
    prefix="model.",
    without=("vocab_size", "bias"),
    flags=(Flag("tie_embeddings", "--untie-embeddings", negate=True),),
)
TRAIN = model_flags(
    TrainConfig,
    prefix="train.",
    without=("min_lr", "warmup", "weight_decay", "max_grad_norm", "val_microbatches", "device"),
    flags=(
        Flag("checkpoint_dir", help="checkpoints here (default with --checkpoint-every: OUT/checkpoints)"),
        Flag("checkpoint_every", default=0),
    ),
)
VARIABILITY = scenario_flags(slow_devices=True, scenario="multimodal", t_f=10.0)
FLAGS = {
    **flag_names((*PIPELINE, *MODEL, *TRAIN)),
    **{f"variability.{field}": flag for field, flag in flag_names(VARIABILITY).items()},
    "variability.params": "scenario parameters",
}


def run_config(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    workload_for: Callable[[RunConfig], ModelWorkload],
    layers: int | None = None,
) -> RunConfig:
    """The run `args` describe, its --data, --hint, --trace and --resume (a checkpoint of `workload_for(run)`)
    read now; `layers`: the model's layer count where it is not the GPT; bad input exits via `parser`."""
    if args.gpus_per_stage < 0:
        parser.error(f"--gpus-per-stage must be >= 0, got {args.gpus_per_stage:g}")
    if args.gpu and args.gpus_per_stage not in (0, 1):
        parser.error(f"--gpu means --gpus-per-stage 1; it contradicts --gpus-per-stage {args.gpus_per_stage:g}")
    if args.compare and checkpoint_dir(args) is not None:
        parser.error(
            "--compare trains the fixed baselines and then the policy from the same initial weights; a run with "
            "checkpoints "
            "(--checkpoint-dir, --checkpoint-every, --resume, --max-restarts) trains one policy: drop one of them"
        )
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        parser.error("--tensorboard needs the tensorboard package: pip install 'rrfp-ray[tensorboard]'")
    try:
        values = flag_values(args, flags=(*PIPELINE, *MODEL, *TRAIN))
        values["pipeline"]["hint"] = _hint(parser, args.hint) if args.hint else None
        values["train"] |= {"checkpoint_dir": checkpoint_dir(args), "device": "cuda" if gpus_per_stage(args) else "cpu"}
        run = RunConfig(**values, variability=variability(args, flags=VARIABILITY), layers=layers)
        corpus_source(run).microbatch(iteration=0, index=0)  # reads --data now: a bad path fails before any actor
        if args.trace:
            _read_trace(parser, run)
        if run.pipeline.policy == PLANNED and run.pipeline.arrange.packs:
            refusal = packing_refusal(workload_for(run))
            if refusal is not None:
                parser.error(f"--arrange {run.pipeline.arrange.value}: {refusal}; --varlen gives the GPT one")
        if run.train.resume:
            run = _resume(run, workload=workload_for(run))
    except CheckpointError as error:
        parser.error(f"--resume: {str(error).removeprefix('resume: ')}")
    except ValidationError as error:
        config_error(parser, error, flags=FLAGS)
    except ValueError as error:
        parser.error(str(error))
    return run


def baselines_of(run: RunConfig, *, compare: bool) -> list[str]:
    """The fixed schedules --compare trains first, each from the same initial weights and data: those at the
    activation memory of 1F1B (`equal_memory_baselines`) but the run's own policy; none without --compare
    or with checkpoints (every run would write them)."""
    if not compare or run.train.checkpoint_dir is not None:
        return []
    pipeline = run.pipeline
    fixed = equal_memory_baselines(chunks=pipeline.chunks, placement=pipeline.layout.placement)
    return [name for name in fixed if name != pipeline.policy]


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


def _resume(run: RunConfig, *, workload: ModelWorkload) -> RunConfig:
    """`run`, resuming the checkpoint in its directory: a CheckpointError unless there is one `workload`'s
    model can resume from. A run of another D trains the checkpoint's global batch D x M: M follows."""
    parameters = model_parameters(workload.layers())
    saved = resume_point(
        directory=Path(run.train.checkpoint_dir), fingerprint=parameters_fingerprint(parameters), parameters=parameters
    ).shape
    batch = saved.dp * saved.microbatches
    if saved.dp != run.pipeline.dp:
        if batch % run.pipeline.dp:
            raise CheckpointError(
                f"resume: --dp {run.pipeline.dp} does not divide the checkpoint's global batch D x M = "
                f"{saved.dp} x {saved.microbatches} = {batch} microbatches an iteration"
            )
        run = run.model_copy(update={"pipeline": run.pipeline.replaced(microbatches=batch // run.pipeline.dp)})
    check_global_batch(saved=saved, pipeline=run.pipeline)
    return run
