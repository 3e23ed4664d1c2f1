"""Soak: many iterations on local Ray; every actor's memory (stage actors and the driver) must stay flat.

    python jobs/soak.py --workload synthetic --iterations 500
    python jobs/soak.py --workload gpt --iterations 200

Prints each actor's RSS after a warm-up (the first tenth, at most 10 iterations) and at the end.
"""

from __future__ import annotations

import argparse
import time

from pydantic import ValidationError

from actors.local_ray import start_ray
from rrfp_ray.cli import (
    Flag,
    add_flags,
    add_log_level_flag,
    config_error,
    configure_logging,
    flag_names,
    flag_values,
    model_flags,
)
from rrfp_ray.job import run_job
from rrfp_ray.train.config import PipelineConfig, VariabilityConfig

WORKLOADS = ("synthetic", "gpt")
PIPELINE = model_flags(PipelineConfig, only=("stages", "microbatches"))
# the synthetic workload's trace: lognormal jitter around --t-f
VARIABILITY = model_flags(VariabilityConfig, only=("t_f",), flags=(Flag("t_f", default=2.0),))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    parser.add_argument("--iterations", type=int, default=200)
    add_flags(parser, model=PipelineConfig, flags=PIPELINE)
    add_flags(parser, model=VariabilityConfig, flags=VARIABILITY)
    parser.add_argument("--policies", default="1f1b,bf,bfw", help="cycled through, one per iteration")
    add_log_level_flag(parser)
    args = parser.parse_args(argv)
    if args.iterations < 2:
        parser.error(f"--iterations must be >= 2, got {args.iterations}")
    try:
        pipeline = PipelineConfig(**flag_values(args, flags=PIPELINE), timeout_s=60)
        variability = VariabilityConfig(scenario="lognormal", **flag_values(args, flags=VARIABILITY))
    except ValidationError as error:
        config_error(parser, error, flags=flag_names([*PIPELINE, *VARIABILITY]))

    import ray

    from actors.driver import PipelineDriver
    from actors.teardown import end_actors

    policies = [pipeline.resolved_policy(name) for name in args.policies.split(",")]
    print(start_ray(num_cpus=max(2, pipeline.stages), log_level=configure_logging(args)))
    driver = PipelineDriver.remote(pipeline=pipeline, workload=_workload(args, pipeline, variability))
    actors = {"driver": driver} | {f"stage {s}": a for s, a in enumerate(ray.get(driver.stage_actors.remote()))}

    def rss() -> list[int]:
        return ray.get([a.rss_bytes.remote() for a in actors.values()])

    warmup = max(1, min(10, args.iterations // 10))
    started = time.perf_counter()
    try:
        for iteration in range(args.iterations):
            ray.get(driver.run_iteration.remote(iteration=iteration, policy=policies[iteration % len(policies)]))
            if iteration + 1 == warmup:
                first = rss()
        last = rss()
        ray.get(driver.shutdown.remote())
        end_actors([driver], timeout_s=30.0)  # exits after its last call, so Ray records that call as finished
    finally:
        ray.kill(driver)
    mib = 1 << 20
    took = time.perf_counter() - started
    print(f"{args.workload}: {args.iterations} iterations in {took:.0f} s; RSS per actor (MiB):")
    for name, a, b in zip(actors, first, last):
        print(f"  {name:8s}: after warm-up {a / mib:7.1f}   at the end {b / mib:7.1f}   change {(b - a) / mib:+6.1f}")
    return {"actors": list(actors), "first": first, "last": last}


def _workload(args: argparse.Namespace, pipeline: PipelineConfig, variability: VariabilityConfig):
    if args.workload == "gpt":
        from rrfp_ray.recipes.config import RunConfig
        from rrfp_ray.recipes.gpt_workload import gpt_workload

        run = RunConfig(
            model={"n_layer": 4, "n_embd": 64, "n_head": 4, "block_size": 32},
            pipeline=pipeline,
            train={"micro_batch_size": 4, "seq_len": 32, "val_every": 0},
        )
        return gpt_workload(run)
    from rrfp_ray.runtime.synthetic import SyntheticWorkload

    return SyntheticWorkload(trace=variability.trace(pipeline=pipeline), payload_elems=65536)


if __name__ == "__main__":
    run_job(main)
