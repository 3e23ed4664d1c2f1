"""What the VLM's microbatches cost each stage, in CPU time: the data's own microbatches and the same samples packed.

    python jobs/bench_vlm_costs.py --stages 2 --iterations 24

Runs each stage's layers forward (no gradient, `torch.set_num_threads(1)`) on every microbatch of the first
iterations, timed by the thread's CPU clock, so the figures hold on a busy machine where wall-clock ones do not.
Per stage it prints the CPU ms per iteration and the spread of a microbatch's cost (P95/P5 and max/min): the
spread the images cause before packing, and what packing the samples by their images (as `bench_vlm.py`'s packed
rows do) leaves of it, with the samples per microbatch and the most images of one sample (the decoder pads every
sample of a microbatch to that many images).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.vlm import add_data_flags
from rrfp_ray.cli import count
from rrfp_ray.job import run_job


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=count, default=2, help="P: the layers cut evenly into this many (default 2)")
    parser.add_argument("--microbatches", type=count, default=8, help="M (default 8)")
    parser.add_argument("--iterations", type=count, default=24, help="iterations of data timed (default 24)")
    parser.add_argument("--seed", type=int, default=0, help="model init and data (default 0)")
    add_data_flags(parser)
    args = parser.parse_args(argv)
    if args.image_tail < 0:
        parser.error(f"argument --image-tail: must be >= 0, got {args.image_tail:g}")

    import torch
    from pydantic import ValidationError

    from rrfp_ray.models.vlm import VLM, VLMConfig
    from rrfp_ray.plan.packing import pack
    from rrfp_ray.train.partition import partition
    from rrfp_ray.train.vlm_data import ImageCaptions

    try:
        model = VLMConfig(max_images=args.max_images, image_size=args.image_size)
    except ValidationError as error:
        parser.error("; ".join(e["msg"] for e in error.errors()))
    layers = VLM(model, seed=args.seed).layers()
    if args.stages > len(layers):
        parser.error(f"argument --stages: the VLM has {len(layers)} layers, got {args.stages}")
    parts = partition(n_layers=len(layers), parts=args.stages)
    data = ImageCaptions(
        model=model,
        micro_batch_size=args.micro_batch_size,
        microbatches=args.microbatches,
        seed=args.seed,
        tail=args.image_tail,
    )
    torch.set_num_threads(1)

    def timed(inputs: tuple) -> list[float]:
        """Per stage, the CPU ms of its layers' forward on one microbatch."""
        ms = []
        with torch.no_grad():
            x = inputs
            for part in parts:
                start = time.thread_time()
                for i in part:
                    x = layers[i](x)
                ms.append(1e3 * (time.thread_time() - start))
        return ms

    rows: dict[str, list[tuple[list[float], int, int]]] = {"own": [], "packed": []}  # (ms per stage, samples, most)
    for k in range(args.iterations):
        packing = pack(costs=data.sample_features(iteration=k), bins=args.microbatches)
        batches = {
            "own": [data.microbatch(iteration=k, index=m) for m in range(args.microbatches)],
            "packed": [data.samples(iteration=k, indexes=list(group)) for group in packing],
        }
        for name, microbatches in batches.items():
            for (images, counts, text), _targets in microbatches:
                rows[name].append((timed((images, counts, text)), len(counts), int(counts.max())))
    result = {}
    print(f"P={args.stages} M={args.microbatches} B={args.micro_batch_size}, {args.iterations} iterations; CPU ms")
    for name, measured in rows.items():
        sizes = [size for _, size, _ in measured]
        most = statistics.fmean(m for _, _, m in measured)
        print(f"{name}: {min(sizes)}-{max(sizes)} samples a microbatch, most images of a sample {most:.1f} (mean)")
        result[name] = []
        for stage in range(args.stages):
            ms = sorted(times[stage] for times, _, _ in measured)
            p5, p95 = ms[round(0.05 * (len(ms) - 1))], ms[round(0.95 * (len(ms) - 1))]
            per_iteration = sum(ms) / args.iterations
            cell = {"ms_per_iteration": per_iteration, "p95_p5": p95 / p5, "max_min": ms[-1] / ms[0]}
            result[name].append(cell)
            print(
                f"  stage {stage}: {per_iteration:.1f} ms an iteration; a microbatch P95/P5 {cell['p95_p5']:.2f}, "
                f"max/min {cell['max_min']:.2f}"
            )
    return result


if __name__ == "__main__":
    run_job(main)
