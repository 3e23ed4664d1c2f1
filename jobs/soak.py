"""Soak: many synthetic iterations on local Ray; every stage actor's memory must stay flat.

    python jobs/soak.py --iterations 200

Prints each stage actor's RSS after a warm-up (the first tenth, at most 10 iterations) and at the end.
"""

from __future__ import annotations

import argparse
import time

from actors.local_ray import start_ray
from rrfp_ray.cli import add_log_level_flag, configure_logging


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--t-f", type=float, default=2.0, help="ms per forward")
    parser.add_argument("--policies", default="1f1b,bf,bfw", help="cycled through, one per iteration")
    add_log_level_flag(parser)
    args = parser.parse_args(argv)
    if args.iterations < 2:
        parser.error("--iterations must be >= 2")

    import ray

    from actors.driver import PipelineDriver
    from rrfp_ray.runtime.synthetic import SyntheticWorkload
    from rrfp_ray.sim.variability import generate
    from rrfp_ray.train.config import PipelineConfig

    pipeline = PipelineConfig(stages=args.stages, microbatches=args.microbatches, timeout_s=30)
    policies = [pipeline.resolved_policy(name) for name in args.policies.split(",")]
    trace = generate(
        scenario="lognormal", stages=args.stages, microbatches=args.microbatches, chunks=1, seed=0, t_f=args.t_f
    )
    print(start_ray(num_cpus=max(2, args.stages), log_level=configure_logging(args)))
    driver = PipelineDriver.remote(pipeline=pipeline, workload=SyntheticWorkload(trace=trace, payload_elems=65536))
    stages = ray.get(driver.stage_actors.remote())

    def rss() -> list[int]:
        return ray.get([s.rss_bytes.remote() for s in stages])

    warmup = max(1, min(10, args.iterations // 10))
    started = time.perf_counter()
    try:
        for iteration in range(args.iterations):
            ray.get(driver.run_iteration.remote(iteration=iteration, policy=policies[iteration % len(policies)]))
            if iteration + 1 == warmup:
                first = rss()
        last = rss()
        ray.get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
    mib = 1 << 20
    print(f"{args.iterations} iterations in {time.perf_counter() - started:.0f} s; RSS per stage actor (MiB):")
    for stage, (a, b) in enumerate(zip(first, last)):
        print(f"  stage {stage}: after warm-up {a / mib:7.1f}   at the end {b / mib:7.1f}   change {(b - a) / mib:+6.1f}")
    return {"first": first, "last": last}


if __name__ == "__main__":
    main()
