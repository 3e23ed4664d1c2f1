"""The results suite: every scenario x schedule x in-flight cap, in the simulator, on the Ray
runtime and against PyTorch's own schedules, into one JSON that `jobs/results.py` renders.

    python jobs/bench_suite.py                      # all four parts -> docs/results/suite.json
    python jobs/bench_suite.py --parts peers        # re-measure one part, keep the others' sections
    python jobs/bench_suite.py --quick --json OUT   # simulator only: P=4, two seeds, two scenarios
    python jobs/bench_suite.py --parts runtime,peers --ray-stages 4 --seeds 1 --iterations 1 \
        --scenarios comm --json OUT                 # a check of the measured parts in minutes
    python jobs/bench_suite.py --parts runtime --ray-stages 8 --scenarios none,comm
                                                    # re-measure those (scenario, P) cells, keep the rest

Re-measuring some (scenario, P) cells of the runtime or peers part keeps that part's other
cells (with the same --seeds and --iterations), so a part can be measured over several runs;
each run is logged with the commit it ran, which RESULTS.md's run log shows.

1. sim: P in 8, 16, 32, M = 4P, seeds 1000..1002 (means; cpw was designed on 200-239 and
   reported on 0-9, so none of these): fixed gpipe, 1f1b, 1f1b-2x, zb-h1, zb-h2 and, at v=2,
   interleaved, zbv and dualpipev; the readiness rules (bf, bfw and any further rule
   `policy_names()` lists) at caps 1x, 2x and inf; ready-1f1b, ready-zb-h1 and, at v=2,
   ready-interleaved, ready-zbv and ready-dualpipev at 1x and 2x; makespan, speedup over
   fixed 1f1b, makespan / lower bound, blocked fraction, peak in-flight and peak activation
   memory. It prints what readiness itself buys against the targets (jobs/benchmarks/attribution.py).
   Then bf's receive-buffer limit swept on multimodal+comm.
2. runtime: the Ray runtime at each P of --ray-stages (4 and 8), M = 4P, synthetic sleep
   workload, --seeds traces per scenario (seeds 1000..): 1f1b, 1f1b-2x, zb-h1, zb-h2,
   interleaved, and the readiness rules at caps 1x and 2x; a warm-up and then --iterations
   timed iterations per run and seed, the runs taking turns; per seed the median, and the
   simulator's prediction for the very same trace and cap. It prints the targets on the
   measured cells beside the same targets on their simulation (jobs/benchmarks/ray_attribution.py).
3. peers: PyTorch's Schedule1F1B, ScheduleInterleavedZeroBubble (zb-h1),
   ScheduleInterleaved1F1B, ScheduleZBVZeroBubble and ScheduleDualPipeV
   (jobs/benchmarks/peers/torch_pipelining.py) on the same traces, message latency a delivery delay
   as in rrfp-ray's runtime (jobs/benchmarks/peers/sleep_module.py).
4. tp: the Ray runtime at PP=2 x TP=2, M=8 on lognormal-0.3, comm and multimodal+comm: 1f1b,
   bf@2x and bfw@2x under each TP agreement protocol (first, common) and without TP (tp1),
   one driver each, a warm-up and then --iterations timed iterations per run; the median, and
   what the agreement cost (rank 0 of each stage). On lognormal-0.3 both TP ranks replay the
   seed-0 trace; on the comm scenarios rank t's messages take the latencies drawn with seed t.
5. fidelity: a real GPT run with no injected sleeps (`--varlen` data, in-process backend)
   at P=2 and 4, fixed 1f1b and bf, each timed iteration replayed in the simulator on its own
   measured trace (jobs/benchmarks/fidelity.py).

Interleaved (v=2) runs the same model: its trace is the v=1 trace with every op cut into two
equal halves, one per chunk (so each stage does exactly the same work per microbatch, and
t_f is 10 ms per chunk); only its message latencies (2P-1 links, not P-1) are fresh draws
of the same scenario with the same seed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.attribution import attribution_lines
from benchmarks.console import show_progress
from benchmarks.fidelity import fidelity_part
from benchmarks.ray_attribution import ray_target_lines
from benchmarks.report import Suite
from benchmarks.suite import (
    BUFFER_SCENARIO,
    DEFAULT_JSON,
    PARTS,
    QUICK_SCENARIOS,
    QUICK_SEEDS,
    SCENARIOS,
    SEEDS,
    buffer_part,
    kept_cells_mismatch,
    merge_cells,
    meta,
    readiness_policies,
    runtime_runs,
    sim_part,
    timed,
)
from benchmarks.suite_ray import TP, TP_SCENARIOS, peers_part, runtime_part, tp_part
from rrfp_ray.cli import count
from rrfp_ray.job import run_job


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="simulator only, P=4, two seeds, none and multimodal+comm")
    parser.add_argument("--json", default=str(DEFAULT_JSON), metavar="OUT", help=f"output (default {DEFAULT_JSON})")
    parser.add_argument(
        "--parts", help=f"comma-separated from {', '.join(PARTS)} (default all); other parts' sections in OUT are kept"
    )
    parser.add_argument("--iterations", type=count, default=5, help="timed iterations on Ray and PyTorch (default 5)")
    parser.add_argument(
        "--seeds", type=count, default=5, help="traces per scenario on Ray and PyTorch, seeds 1000.. (default 5)"
    )
    parser.add_argument("--stages", default="8,16,32", help="comma-separated P for the simulator (default 8,16,32)")
    parser.add_argument("--ray-stages", default="4,8", help="comma-separated P for Ray and PyTorch (default 4,8)")
    parser.add_argument("--scenarios", help="comma-separated scenario labels (default all; --quick: its two)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in (args.parts or ",".join(PARTS)).split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"argument --parts: unknown {unknown or 'empty'}; choose from {', '.join(PARTS)}")
    if args.quick and args.parts is not None and parts != ["sim"]:
        parser.error("argument --parts: --quick runs the simulator part only")
    for flag in ("stages", "ray_stages"):
        text = getattr(args, flag)
        try:
            values = [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            parser.error(f"argument --{flag.replace('_', '-')}: not a comma-separated list of integers: {text!r}")
        if not values or min(values) < 2:
            parser.error(f"argument --{flag.replace('_', '-')}: every P must be >= 2, got {text!r}")
        setattr(args, flag, values)
    labels = [s.label for s in SCENARIOS]
    if args.scenarios is not None:
        args.scenarios = [label.strip() for label in args.scenarios.split(",") if label.strip()]
        unknown = sorted(set(args.scenarios) - set(labels))
        if unknown or not args.scenarios:
            parser.error(f"argument --scenarios: unknown {unknown or 'empty'}; choose from {', '.join(labels)}")
    if Path(args.json) == DEFAULT_JSON:
        DEFAULT_JSON.parent.mkdir(parents=True, exist_ok=True)
    elif not Path(args.json).resolve().parent.is_dir():
        parser.error(f"argument --json: no directory {Path(args.json).resolve().parent}")
    args.parts = ["sim"] if args.quick else parts
    return args


def each_depth(stages: Sequence[int], part: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """One part at every P, its rows and errors together (startup times by P)."""
    merged: dict[str, Any] = {"rows": [], "errors": []}
    for p in stages:
        section = part(p)
        merged["rows"] += section["rows"]
        merged["errors"] += section["errors"]
        if "startup_s" in section:
            merged.setdefault("startup_s", {}).update({f"P={p} {k}": v for k, v in section["startup_s"].items()})
    return merged


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    show_progress()
    command = shlex.join(["python", "jobs/bench_suite.py", *sys.argv[1:]])
    started = time.perf_counter()
    out = Path(args.json)
    chosen = args.scenarios or (QUICK_SCENARIOS if args.quick else [s.label for s in SCENARIOS])
    scenarios = [s for s in SCENARIOS if s.label in chosen]
    stages, seeds = ((4,), QUICK_SEEDS) if args.quick else (args.stages, SEEDS)
    rules = readiness_policies()
    keep = not args.quick and set(args.parts) != set(PARTS) and out.exists()
    data = json.loads(out.read_text()) if keep else {}
    listed = [s for s in SCENARIOS if s.label in QUICK_SCENARIOS] if args.quick else list(SCENARIOS)
    data["meta"] = meta(quick=args.quick, scenarios=listed, rules=rules, stages=stages, seeds=seeds)
    ray_seeds = list(range(SEEDS.start, SEEDS.start + args.seeds))
    timing = {"seeds": ray_seeds, "warmup": 1, "iterations": args.iterations}
    cells = {(s.label, p) for s in scenarios for p in args.ray_stages}
    kept = {part: data[part] for part in set(args.parts) & set(data)}
    if mismatch := kept_cells_mismatch(data=kept, cells=cells, seeds=ray_seeds, iterations=args.iterations):
        sys.exit(f"{out}: {mismatch}")
    if "sim" in args.parts:
        data["sim"] = timed(
            part="sim",
            make=lambda: sim_part(scenarios=scenarios, stages=stages, seeds=seeds, rules=rules),
            command=command,
        )
        buffer_spec = next(s for s in SCENARIOS if s.label == BUFFER_SCENARIO)
        buffer_stages = (4,) if args.quick else (8, 16)
        data["buffer"] = timed(
            part="buffer",
            make=lambda: buffer_part(spec=buffer_spec, stages=buffer_stages, seeds=seeds),
            command=command,
        )
        for line in attribution_lines(Suite(data)):
            print(line, flush=True)
    if "runtime" in args.parts:
        runs = runtime_runs(rules=rules)
        data["runtime"] = merge_cells(
            old=data.get("runtime"),
            new=timed(
                part="runtime",
                make=lambda: each_depth(
                    args.ray_stages,
                    lambda p: runtime_part(scenarios=scenarios, runs=runs, stages=p, microbatches=4 * p, **timing),
                ),
                command=command,
            ),
        )
        data["runtime"].update(stages=sorted({row["stages"] for row in data["runtime"]["rows"]}), **timing)
        for line in ray_target_lines(Suite(data)):
            print(line, flush=True)
    if "peers" in args.parts:
        data["peers"] = merge_cells(
            old=data.get("peers"),
            new=timed(
                part="peers",
                make=lambda: each_depth(
                    args.ray_stages, lambda p: peers_part(scenarios=scenarios, stages=p, microbatches=4 * p, **timing)
                ),
                command=command,
            ),
        )
        data["peers"].update(stages=sorted({row["stages"] for row in data["peers"]["rows"]}), **timing)
    if "tp" in args.parts:
        tp_shape = {"stages": 2, "microbatches": 8, "warmup": 1, "iterations": args.iterations}
        tp_scenarios = [s for s in SCENARIOS if s.label in TP_SCENARIOS]
        data["tp"] = timed(part="tp", make=lambda: tp_part(scenarios=tp_scenarios, **tp_shape), command=command)
        data["tp"].update(tp=TP, **tp_shape)
    if "fidelity" in args.parts:
        data["fidelity"] = timed(
            part="fidelity",
            make=lambda: fidelity_part(stages=(2, 4), warmup=1, iterations=args.iterations),
            command=command,
        )
    data["meta"]["wall_s"] = time.perf_counter() - started
    data["meta"]["parts_run"] = args.parts
    out.write_text(json.dumps(data, indent=1))
    print(f"wrote {out} in {data['meta']['wall_s']:.0f} s", flush=True)
    return data


if __name__ == "__main__":
    run_job(main)
