"""Measured against simulated: run one synthetic trace on Ray and in the simulator.

Every policy runs on one driver (the stage actors sleep each op's trace duration and send
real tensors over their links: --backend, TCP on CPUs by default); the simulator replays the very same trace. Per policy
it prints the median measured iteration time (optimizer step included), the simulated one
(the op schedule alone: the simulator has no optimizer step, so the ratio compares it with
the measured time less the step), and the speedup over the fixed baseline (1f1b,
interleaved when --chunks > 1, zbv for the V-placed policies), measured and predicted:

    python jobs/bench_runtime.py --scenario lognormal --sigma 0.3 --microbatches 16
    python jobs/bench_runtime.py --chunks 2 --policies zbv,ready-zbv,dualpipev,ready-dualpipev

It also simulates the trace under the transport model (`rrfp_ray.sim.simulator.TransportModel`:
each message costs what this run measured, or --message-ms, and a link carries one message at a
time: over TCP for the median send of this run, over gloo or NCCL until the receiver took it) and
prints meas/sim both ways. --breakdown prints the runtime's per-op overhead
(`rrfp_ray.runtime.breakdown`, "one message" among it: the transport model's message cost), median and
p90 in microseconds, and its CPU per executed op by thread role (`rrfp_ray.runtime.cpu`; in --json
as cpu_us_per_op):

    python jobs/bench_runtime.py --stages 8 --microbatches 32 --iterations 3 --t-f 2 --breakdown

With `planned` among --policies, each of --seeds seeds generates a run of --iterations iterations of the
scenario (features and durations per iteration) that every policy runs in turn, each slot sleeping the durations
of the data microbatch the plan puts there; `planned` plans iteration k+1 on this process's planning thread while
the stages run k. It prints each policy's mean iteration per seed, planned over the best fixed schedule of each
seed (geometric mean, lowest, highest) and how long the stages waited for plans (`benchmarks.runtime_planned`):

    python jobs/bench_runtime.py --stages 4 --microbatches 16 --policies 1f1b,zb-h1,gpipe,planned \
        --scenario multimodal+lognormal --cap 1x --t-f 10 --iterations 8 --seeds 5

The policies of one run share one pipeline, so they must share a placement: looped
(gpipe, 1f1b, interleaved, looped-bfs, zb-h1, zb-interleaved, bf, bfw, cpw and their ready-*)
or V (zbv, dualpipev, ready-zbv, ready-dualpipev); a mix is refused before Ray starts.

With --trace FILE the trace's P, M and v set --stages, --microbatches and --chunks.

With --tp T each stage is T actors that agree on their ops (`rrfp_ray.policy.agreement`); it also
prints the TP-coordination share of the stages' time, the disagreements, rounds per
iteration (summed over stages; rank 0 of each) and ms per round. --rank-comm gives each TP
rank its own message latencies (the simulator then sees rank 0's):

    python jobs/bench_runtime.py --stages 2 --tp 2 --microbatches 8 --scenario lognormal --sigma 0.3
    python jobs/bench_runtime.py --stages 2 --tp 2 --microbatches 8 --scenario comm --comm-ms 2 --rank-comm

With --dp D the whole pipeline runs D times, each stage summing a synthetic gradient of --grad-mb
MB per chunk (--grad-layers tensors) over its replicas in --dp-bucket-mb buckets, each bucket as
soon as the chunk's last weight-gradient op has finalized its tensors (--no-overlap: after every
stage's last op); it prints the exposed share of the reduce time (past every stage's last op, and
past the stage's own), measured and simulated, and the bytes summed and received:

    python jobs/bench_runtime.py --dp 2 --stages 4 --microbatches 16 --grad-mb 25 --policies 1f1b,bfw

The synthetic model has --layers layers per stage (per virtual stage with --chunks > 1), each holding
--layer-mb MB of real parameters; the trace's durations are for the even split, so with --split each
op sleeps its device's share per layer it holds (the simulator sees the same). --measure-every N has
the stages measure their layers' costs every N iterations (`StageStats.layer_costs`, docs/observe.md):

    python jobs/bench_runtime.py --scenario imbalance --layers 2 --split 3,2,2,1 --measure-every 2

With --rebalance each policy runs on its own pipeline of --layers layers a stage, evenly split at the
start, its iterations one after another, measured every --measure-every and moved by the rebalancer
(docs/rebalancing.md); then on the best split for the scenario's true costs. It prints and writes per
policy `rebalance`: the median iteration before the first move and after the last, the best split's,
the moves and their seconds, and the wall-clock iteration with --rebalance over that of the same pipeline
without it, the two taking turns (`benchmarks.runtime_rebalance`):

    python jobs/bench_runtime.py --scenario imbalance --layers 4 --rebalance --measure-every 1 \\
        --rebalance-window 5 --iterations 30 --policies 1f1b,bfw --json rebalance.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from actors.local_ray import start_ray
from rrfp_ray.cli import add_flags, add_log_level_flag, add_scenario_flags, configure_logging, write_pictures
from rrfp_ray.job import run_job

if TYPE_CHECKING:
    from rrfp_ray.sim.trace import Trace
    from rrfp_ray.train.config import PipelineConfig


def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, PipelineConfig, list[Trace], list[str]]:
    """The flags, the pipeline, the trace of each TP rank (one unless --rank-comm) and the policies."""
    from benchmarks import runtime
    from rrfp_ray.train.config import PLANNED, PipelineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    pipe = parser.add_argument_group("pipeline")
    add_flags(pipe, model=PipelineConfig, flags=runtime.PIPELINE)
    pipe.add_argument("--grad-mb", type=float, default=25.0, help="with --dp: MB of synthetic gradient per chunk")
    pipe.add_argument(
        "--grad-layers",
        type=int,
        default=12,
        help="with --dp: tensors the gradient is, finalized one by one through the chunk's last weight-gradient op "
        "(default 12: the weight matrices of three GPT blocks)",
    )
    pipe.add_argument(
        "--reduce-mb-per-s",
        type=float,
        default=None,
        help="with --dp: the simulator's reduction bandwidth (default: the measured bytes / reduce time of this run)",
    )
    pipe.add_argument(
        "--reduce-latency-ms", type=float, default=0.0, help="with --dp: the simulator's latency per bucket"
    )
    pipe.add_argument(
        "--layers",
        type=int,
        default=1,
        help="layers per stage (per virtual stage with --chunks > 1) in the even split the trace's durations are for; "
        "--split moves them, each costing its device's share",
    )
    pipe.add_argument("--layer-mb", type=float, default=0.0, help="MB of real parameters each layer holds")
    pipe.add_argument(
        "--rank-comm",
        action="store_true",
        help="with --tp: each TP rank's messages take their own latencies (the scenario drawn with seed + rank)",
    )
    bench = parser.add_argument_group("benchmark")
    bench.add_argument(
        "--policies", default=None, help="comma-separated (default: 1f1b,bf,bfw; interleaved,bf,bfw for v > 1)"
    )
    bench.add_argument(
        "--seeds",
        type=int,
        default=1,
        help=f"with {PLANNED} among --policies: seeds --variability-seed.. of the scenario, each a generated run of "
        "--iterations iterations that every policy runs in turn",
    )
    bench.add_argument("--payload-elems", type=int, default=4096, help="float32 elements per message")
    bench.add_argument("--iterations", type=int, default=5, help="per policy; the first is a warm-up when > 1")
    bench.add_argument(
        "--breakdown", action="store_true", help="print per policy the runtime's per-op overhead (median, p90 in us)"
    )
    bench.add_argument(
        "--message-ms",
        type=float,
        default=None,
        help="the simulator's transport model: ms a message costs (default: measured in this run)",
    )
    bench.add_argument("--json", default=None, metavar="OUT", help="write the per-policy figures here")
    bench.add_argument(
        "--out", default=None, metavar="DIR", help="write a Perfetto trace and a diagram per policy here"
    )
    add_scenario_flags(parser, flags=runtime.VARIABILITY)
    add_log_level_flag(parser)
    args = parser.parse_args(argv)
    pipeline, traces, names = runtime.checked(parser, args=args)
    return args, pipeline, traces, names


def main(argv: list[str] | None = None) -> dict:
    args, pipeline, traces, names = parse(argv)
    from rrfp_ray.train.config import PLANNED

    if PLANNED in names:
        from benchmarks import runtime_planned

        return runtime_planned.job(args=args, pipeline=pipeline, names=names)
    import ray

    from actors.driver import PipelineDriver
    from actors.teardown import end_actors
    from benchmarks import runtime, runtime_rebalance
    from rrfp_ray.runtime.synthetic import SyntheticWorkload

    model = runtime.layer_model(args, pipeline=pipeline)
    trace = model.as_run(traces[0])  # what the stages sleep, for the simulator
    simulated = runtime.simulated_ms(pipeline=pipeline, trace=trace, names=names)
    log_level = configure_logging(args)
    # with --rebalance, a second pipeline without it takes turns with the rebalanced ones (`runtime_rebalance`)
    pipelines = 2 if pipeline.balance.rebalance else 1
    print(start_ray(num_cpus=max(2, pipelines * pipeline.actors), log_level=log_level))
    workload = SyntheticWorkload(
        trace=traces[0],
        payload_elems=args.payload_elems,
        rank_comm=tuple(traces) if args.rank_comm else (),
        grad_elems=int(args.grad_mb * 2**20) // 4 if pipeline.dp > 1 else 0,
        grad_layers=args.grad_layers,
        layers=args.layers,
        layer_bytes=model.layer_bytes,
        layer_split=model.split,
    )
    driver = PipelineDriver.remote(pipeline=pipeline, workload=workload)
    try:
        print(f"{pipeline.actors} stage actors up in {ray.get(driver.startup_seconds.remote()):.1f} s")
        if pipeline.balance.rebalance:
            return runtime_rebalance.job(driver=driver, pipeline=pipeline, workload=workload, names=names, args=args)
        reports = runtime.measure(driver=driver, pipeline=pipeline, names=names, iterations=args.iterations)
        backend = ray.get(driver.link_transport.remote())
        ray.get(driver.shutdown.remote())
        end_actors([driver], timeout_s=30.0)  # exits after its last call, so Ray records that call as finished
    finally:
        ray.kill(driver)
    results, transport = runtime.compare(
        reports=reports, simulated=simulated, pipeline=pipeline, trace=trace, names=names, args=args, backend=backend
    )
    if args.out:
        write_pictures(out=Path(args.out), runs=reports)
    lines = runtime.report_lines(results=results, reports=reports, pipeline=pipeline, transport=transport, args=args)
    print("\n".join(lines))
    summary = {
        "policies": results,
        "message_ms": transport.message_ms,
        "send_ms": transport.send_ms,
        "links": backend.value,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
        print(f"wrote {args.json}")
    return summary


if __name__ == "__main__":
    run_job(main)
