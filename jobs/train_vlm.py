"""Train a small vision-language model (`rrfp_ray.models.vlm`: a ViT encoder, a projection and our
GPT decoder) on captioned images through a readiness-driven (RRFP) pipeline on Ray.

A sample holds 0..--max-images images (P(n) ~ (n + 1) ** -tail: heavy-tailed) and a caption that
names their kinds, so the encoder's work follows the data and the loss falls only by looking.
No delay is injected by default (--scenario none): every op's time is the model's own compute.
Every other flag, output and report is jobs/train_gpt.py's; --n-layer, --n-head and --n-embd size
the decoder, --micro-batch-size counts samples; --seq-len, --block-size, --data and --varlen do not
apply (a caption's length is its images').

    python jobs/train_vlm.py --stages 2 --microbatches 8

On a cluster, from the repo root:

    RAY_AUTH_MODE=token ray job submit --working-dir . -- python jobs/train_vlm.py --gpu --backend auto
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import TYPE_CHECKING

from rrfp_ray.installed import require_core

require_core(program="train_vlm.py")  # before the first import of torch or ray

from actors.job_setup import checked_run
from actors.train_gpt import build_parser, train_on_ray
from rrfp_ray.cli import Flag, add_flags, config_error, flag_names, flag_values, model_flags
from rrfp_ray.job import run_job

if TYPE_CHECKING:
    from rrfp_ray.models.vlm import VLMConfig
    from rrfp_ray.recipes.config import RunConfig

DECODER = {"n_layer": "--n-layer", "n_head": "--n-head", "n_embd": "--n-embd"}  # train_gpt's model flags


def image_flags() -> tuple[Flag, ...]:
    """A flag for each `VLMConfig` field of the images and the encoder."""
    from rrfp_ray.models.vlm import VLMConfig

    return model_flags(VLMConfig, without=("channels", *DECODER, "bias", "tie_embeddings"))


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, RunConfig, VLMConfig]:
    parser = build_parser(description=__doc__)
    from rrfp_ray.models.vlm import VLMConfig

    images = parser.add_argument_group("images")
    add_flags(images, model=VLMConfig, flags=image_flags())
    images.add_argument("--image-tail", type=float, default=1.0, help="P(n images) ~ (n + 1) ** -tail; 0: uniform")
    parser.set_defaults(scenario="none")
    args = parser.parse_args(argv)
    if args.out is None and not os.environ.get("RAY_ADDRESS"):
        args.out = "runs/train_vlm"
    for flag in ("data", "varlen"):
        if getattr(args, flag):
            parser.error(f"--{flag}: the VLM trains on captioned images, not text")
    model = vlm_config(parser, args=args)
    from rrfp_ray.recipes.vlm_workload import vlm_workload

    workload_for = functools.partial(vlm_workload, model=model, tail=args.image_tail)
    run = checked_run(parser, args=args, workload_for=workload_for, layers=model.layer_count)
    try:
        workload_for(run)  # the dry run, before any actor starts
    except ValueError as error:
        parser.error(str(error))
    return args, run, model


def vlm_config(parser: argparse.ArgumentParser, *, args: argparse.Namespace) -> VLMConfig:
    """The image flags and the decoder's (--n-layer, --n-head, --n-embd, --untie-embeddings) as a `VLMConfig`."""
    from pydantic import ValidationError

    from rrfp_ray.models.vlm import VLMConfig

    if args.image_tail < 0:
        parser.error(f"--image-tail must be >= 0, got {args.image_tail:g}")
    images = image_flags()
    try:
        return VLMConfig(
            **flag_values(args, flags=images),
            **{field: getattr(args, field) for field in DECODER},
            tie_embeddings=not args.untie_embeddings,
        )
    except ValidationError as error:
        config_error(parser, error, flags=flag_names(images) | DECODER)


def main(argv: list[str] | None = None) -> dict:
    args, run, model = parse(argv)
    from rrfp_ray.recipes.vlm_workload import vlm_trainer

    trainer_for = functools.partial(vlm_trainer, model=model, tail=args.image_tail)
    return train_on_ray(args=args, run=run, trainer_for=trainer_for, program="train_vlm.py")


if __name__ == "__main__":
    run_job(main)
