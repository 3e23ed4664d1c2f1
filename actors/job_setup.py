"""jobs/train_gpt.py's flags checked against Ray's side before any actor starts: where the
stages will run (this machine or a cluster), whether its NCCL and GPUs are there, and the
placement the flags ask for."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import torch
from pydantic import ValidationError

from actors.local_ray import attaching
from rrfp_ray.cli import config_error, writable_dir
from rrfp_ray.recipes.gpt_cli import default_out, gpus_per_stage, run_config
from rrfp_ray.recipes.gpt_workload import gpt_workload
from rrfp_ray.runtime.transport import LinkTransport

if TYPE_CHECKING:
    from collections.abc import Callable

    from actors.placement import StagePlacement
    from rrfp_ray.recipes.config import RunConfig
    from rrfp_ray.train.workload import ModelWorkload


def checked_run(
    parser: argparse.ArgumentParser,
    *,
    args: argparse.Namespace,
    workload_for: Callable[[RunConfig], ModelWorkload] = gpt_workload,
    layers: int | None = None,
) -> RunConfig:
    """The run the flags ask for, every check passed (--resume: a checkpoint of `workload_for(run)`);
    `layers`: the model's layer count where it is not the GPT; sets `args.out` (default: `default_out`)
    and `args.placement`."""
    args.out = str(default_out()) if args.out is None else args.out
    run = run_config(parser, args, workload_for=workload_for, layers=layers)
    args.placement = stage_placement(parser, args=args)
    check_local_devices(parser, args=args, run=run)
    writable_dir(parser, flag="--out", path=args.out)
    return run


def check_local_devices(parser: argparse.ArgumentParser, *, args: argparse.Namespace, run: RunConfig) -> None:
    """Without a cluster to attach to, the stages run on this machine: NCCL links and GPUs must be here."""
    if attaching():
        return  # the cluster's nodes hold the GPUs; placement waits for them
    where = "this run would start a local Ray here (set RAY_ADDRESS to run on a cluster)"
    if run.pipeline.backend is LinkTransport.NCCL:
        from actors.collective import nccl_missing

        missing = nccl_missing()
        if missing is not None:
            parser.error(f"--backend nccl: {missing}; {where}")
    if gpus_per_stage(args) and not torch.cuda.is_available():
        flag = "--gpu" if args.gpu else f"--gpus-per-stage {args.gpus_per_stage:g}"
        parser.error(f"{flag}: no CUDA device is visible (torch.cuda.is_available() is False); {where}")


def stage_placement(parser: argparse.ArgumentParser, *, args: argparse.Namespace) -> StagePlacement:
    """--gpus-per-stage/--gpu, --stage-resources and --placement-timeout as a checked `StagePlacement`."""
    from actors.placement import StagePlacement

    if not isinstance(args.stage_resources, dict):
        parser.error(f"--stage-resources: a JSON object of resource amounts, got {args.stage_resources!r}")
    try:
        return StagePlacement(
            gpus_per_stage=gpus_per_stage(args), resources=args.stage_resources, timeout_s=args.placement_timeout
        )
    except ValidationError as error:
        flags = {
            "gpus_per_stage": "--gpus-per-stage",
            "resources": "--stage-resources",
            "timeout_s": "--placement-timeout",
        }
        config_error(parser, error, flags=flags)
