"""The vision-language model of `rrfp_ray.models.vlm` (a ViT encoder, a projection, our GPT decoder)
trained through the library's `Trainer` on captioned images: 0..4 images a sample, heavy-tailed,
so the encoder's work changes from one microbatch to the next with the data.

The model's layer list is split evenly over 2 stages x 2 chunks, the encoder's layers first.
The data source tells the images of every microbatch before the iteration (`features`).

    python examples/multimodal.py          # every stage a thread of this process
    python examples/multimodal.py --ray    # every stage a Ray actor (starts a local Ray)
"""

from __future__ import annotations

import argparse
import functools

from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.models.vlm import VLMConfig, caption_loss
from rrfp_ray.recipes.vlm_workload import VLMLayers
from rrfp_ray.train.vlm_data import ImageCaptions

MODEL = VLMConfig(classes=4, max_images=4, image_size=8, encoder_layers=2, encoder_embd=32, n_layer=2, n_embd=32)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray", action="store_true", help="run the stages as Ray actors")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--policy", default="bf")
    args = parser.parse_args(argv)
    backend = None
    if args.ray:
        from actors.backend import RayBackend

        backend = RayBackend()
    data = functools.partial(ImageCaptions, model=MODEL, micro_batch_size=6, microbatches=4, seed=0, tail=0.5)
    print(f"images per microbatch of iteration 0: {data().features(iteration=0)}")
    trainer = Trainer(
        model=VLMLayers(config=MODEL, seed=0),  # a builder: every stage builds the same weights
        loss_fn=caption_loss,  # (sum, count): the iteration's loss is the mean over its caption tokens
        data=data(),
        val_data=data(split="val"),
        optimizer=Optim(lr=3e-3, warmup=5, total=args.iterations),
        pipeline=PipelineConfig(stages=2, chunks=2, microbatches=4, policy=args.policy, timeout_s=60),
        backend=backend,
    )
    with trainer:
        losses = [report.loss for report in trainer.fit(args.iterations)]
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation loss {trainer.evaluate():.4f}")
    return losses


if __name__ == "__main__":
    main()
