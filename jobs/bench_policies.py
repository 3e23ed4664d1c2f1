"""Where the policies land against the lower bounds: 1f1b, bf, bfw and cpw on the scenario suite.

    python jobs/bench_policies.py --out docs/policy_past_bf.md

1. For every scenario below at P=--stages, M=--microbatches, v=1, cap --cap, seeds 0..--seeds-1:
   per policy the means of makespan / stage-window bound, makespan / best bound (both from
   `rrfp_ray.sim.simulator.bounds` for the policy's layout), speedup over fixed 1f1b, and peak
   in-flight over 1f1b's; then cpw against bfw seed by seed.
2. cpw against bfw where memory is tighter or the pipeline deeper: caps 1x, 1.5x, 2x at P and 2P.
"""

from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy, make_policy
from rrfp_ray.sim.simulator import bounds, simulate
from rrfp_ray.sim.variability import Trace, generate

POLICIES = ("1f1b", "bf", "bfw", "cpw")
BASELINE = "1f1b"
SCENARIOS = (
    ("none", "none", {}),
    ("lognormal 0.3", "lognormal", {}),
    ("lognormal 0.6", "lognormal", {"sigma": 0.6}),
    ("straggler", "straggler", {}),
    ("comm heavy tail", "comm", {}),
    ("imbalance", "imbalance", {}),
    ("multimodal", "multimodal", {}),
    ("multimodal+comm", "multimodal+comm", {}),
)
SENSITIVITY_SCENARIOS = ("lognormal 0.6", "multimodal", "multimodal+comm")
SENSITIVITY_CAPS = ("1x", "1.5x", "2x")


@dataclass(frozen=True)
class Cell:
    """Means over seeds for one policy on one scenario."""

    window: float
    best: float
    speedup: float
    peak: float


@dataclass(frozen=True)
class Paired:
    """cpw's makespan change over bfw's, in percent, seed by seed."""

    mean: float
    stderr: float
    wins: int
    ties: int
    losses: int


@dataclass(frozen=True)
class Row:
    cells: dict[str, Cell]
    paired: Paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=8, help="pipeline stages P (default 8)")
    parser.add_argument("--microbatches", type=int, help="microbatches M (default 4P)")
    parser.add_argument("--seeds", type=int, default=10, help="traces per scenario, seeds 0..N-1 (default 10)")
    parser.add_argument("--cap", default="2x", help="in-flight cap of the main table (default 2x)")
    parser.add_argument("--out", help="write the Markdown report here")
    args = parser.parse_args()
    if args.stages < 1:
        parser.error(f"argument --stages: must be >= 1, got {args.stages}")
    microbatches = args.microbatches or 4 * args.stages
    if microbatches < args.stages:
        parser.error(f"argument --microbatches: must be >= --stages (1f1b needs M >= P), got {microbatches}")
    if args.seeds < 2:
        parser.error(f"argument --seeds: must be >= 2 (a standard error needs two), got {args.seeds}")
    try:
        cap = Cap.parse(args.cap)
    except ValueError as error:
        parser.error(f"argument --cap: {error}")

    seeds = range(args.seeds)
    table = {
        label: suite_row(label=label, stages=args.stages, microbatches=microbatches, seeds=seeds, cap=cap)
        for label, _, _ in SCENARIOS
    }
    sensitivity = {
        (label, stages, text): paired(
            label=label, stages=stages, microbatches=4 * stages, seeds=seeds, cap=Cap.parse(text)
        )
        for label in SENSITIVITY_SCENARIOS
        for stages in (args.stages, 2 * args.stages)
        for text in SENSITIVITY_CAPS
    }
    for (label, stages, text), p in sensitivity.items():
        print(f"{label:>16} P={stages:<3} cap {text:<4} cpw vs bfw {p.mean:+.2f}% ± {p.stderr:.2f}", flush=True)
    report = markdown(
        table=table, sensitivity=sensitivity, stages=args.stages, microbatches=microbatches, seeds=args.seeds, cap=cap
    )
    if args.out:
        Path(args.out).write_text(report)
    else:
        print(report)


def trace_for(*, label: str, stages: int, microbatches: int, seed: int) -> Trace:
    scenario, params = next((s, p) for name, s, p in SCENARIOS if name == label)
    return generate(scenario=scenario, stages=stages, microbatches=microbatches, chunks=1, seed=seed, **params)


def policies(*, stages: int, microbatches: int) -> dict[str, Policy]:
    return {n: make_policy(name=n, stages=stages, chunks=1, microbatches=microbatches) for n in POLICIES}


def suite_row(*, label: str, stages: int, microbatches: int, seeds: range, cap: Cap) -> Row:
    chosen = policies(stages=stages, microbatches=microbatches)
    samples: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in POLICIES}
    deltas = []
    for seed in seeds:
        trace = trace_for(label=label, stages=stages, microbatches=microbatches, seed=seed)
        reports = {n: simulate(policy=p, trace=trace, cap=cap) for n, p in chosen.items()}
        base = reports[BASELINE]
        for name, report in reports.items():
            bound = bounds(trace=trace, split=chosen[name].split)
            samples[name].append(
                (
                    report.makespan_ms / bound.stage_window_ms,
                    report.makespan_ms / bound.best_ms,
                    base.makespan_ms / report.makespan_ms,
                    report.peak_inflight / base.peak_inflight,
                )
            )
        deltas.append(percent(new=reports["cpw"].makespan_ms, old=reports["bfw"].makespan_ms))
    cells = {n: Cell(*(statistics.mean(column) for column in zip(*rows))) for n, rows in samples.items()}
    text = "  ".join(f"{n} {c.window:.3f}/{c.speedup:.3f}x" for n, c in cells.items())
    print(f"{label:>16} P={stages} M={microbatches} cap {cap}: {text}", flush=True)
    return Row(cells=cells, paired=summarize(deltas))


def paired(*, label: str, stages: int, microbatches: int, seeds: range, cap: Cap) -> Paired:
    chosen = policies(stages=stages, microbatches=microbatches)
    deltas = []
    for seed in seeds:
        trace = trace_for(label=label, stages=stages, microbatches=microbatches, seed=seed)
        new, old = (simulate(policy=chosen[n], trace=trace, cap=cap).makespan_ms for n in ("cpw", "bfw"))
        deltas.append(percent(new=new, old=old))
    return summarize(deltas)


def percent(*, new: float, old: float) -> float:
    return 100.0 * (new - old) / old


def summarize(deltas: list[float]) -> Paired:
    tie = 1e-9
    return Paired(
        mean=statistics.mean(deltas),
        stderr=statistics.stdev(deltas) / math.sqrt(len(deltas)),
        wins=sum(d < -tie for d in deltas),
        ties=sum(abs(d) <= tie for d in deltas),
        losses=sum(d > tie for d in deltas),
    )


def markdown(
    *,
    table: dict[str, Row],
    sensitivity: dict[tuple[str, int, str], Paired],
    stages: int,
    microbatches: int,
    seeds: int,
    cap: Cap,
) -> str:
    command = shlex.join(["python", *sys.argv])
    lines = [
        "# Past BF: cpw",
        "",
        f"Generated by `{command}` (run from the repository root); deterministic, about 40 s on 2 CPUs.",
        "",
        "## The rule",
        "",
        "`cpw` is `bfw` (backward/forward alternation over ready ops, W only when no F or B is eligible)",
        "plus one priority-inheritance step. An admission (chunk-0 F) starts a microbatch's whole chain, the",
        "longest remaining path a stage can start. When an admission is ready but held by the cap, and the",
        "stage's F->B count is at a level at which it was allowed to admit before, the F->B cap cannot be the",
        "one that binds: the F->W cap is, and only a chunk-0 W of a microbatch past its B can free it. That",
        "W then runs first (lowest microbatch), ahead of ready backwards. Everything else is `bfw`, with the",
        "same reference list (zb-h1) and therefore the same caps and the same peak in-flight bound.",
        "",
        "Information used at decision time: the stage's own ready set, its own count of chunk-0 F and B it",
        "has run, and the arbiter's `admit` flag. No durations at all, neither expected nor measured, so the",
        "runtime runs it unchanged through `Policy.picker(stage=)` / `add` / `pick(admit=)`.",
        "",
        "## Scenario suite",
        "",
        f"P={stages}, M={microbatches}, v=1, cap {cap} for every policy (fixed 1f1b ignores it), t_f=20 ms,",
        f"B+W=40 ms, scenario parameters at their defaults except lognormal 0.6; means over seeds 0..{seeds - 1}.",
        "/window = makespan / `bounds(...).stage_window_ms`; /best = makespan / `bounds(...).best_ms`",
        "(both for the policy's own layout: bf and 1f1b without the B/W split, bfw and cpw with it);",
        "speedup = fixed 1f1b makespan / makespan; peak = `report.peak_inflight` / 1f1b's (F->W for split",
        "policies, F->B otherwise).",
        "",
        "| scenario | policy | /window | /best | speedup over 1f1b | peak in-flight vs 1f1b |",
        "|---|---|---|---|---|---|",
    ]
    for label, row in table.items():
        for name, c in row.cells.items():
            lines.append(f"| {label} | {name} | {c.window:.3f} | {c.best:.3f} | {c.speedup:.3f}x | {c.peak:.2f}x |")
    lines += ["", "Against the aim (makespan <= 1.10 x the stage-window bound, peak in-flight <= 2x 1F1B's):", ""]
    for name in POLICIES:
        worst_label, worst = max(((label, row.cells[name]) for label, row in table.items()), key=lambda x: x[1].window)
        peak = max(row.cells[name].peak for row in table.values())
        met = "met" if worst.window <= 1.10 and peak <= 2.0 else "not met"
        lines.append(f"- {name}: {met}; worst /window {worst.window:.3f} ({worst_label}), peak {peak:.2f}x")
    lines += [
        "",
        f"cpw against bfw on the same traces (makespan change, mean ± standard error over the {seeds} seeds;",
        "wins / ties / losses count seeds where cpw is faster / equal / slower):",
        "",
        "| scenario | cpw vs bfw | wins / ties / losses |",
        "|---|---|---|",
    ]
    for label, row in table.items():
        p = row.paired
        lines.append(f"| {label} | {p.mean:+.2f}% ± {p.stderr:.2f} | {p.wins} / {p.ties} / {p.losses} |")
    lines += [
        "",
        "## Where the rule matters: tighter caps, deeper pipelines",
        "",
        f"cpw against bfw, M=4P, seeds 0..{seeds - 1}, same layout and caps for both.",
        "",
        "| scenario | P | cap | cpw vs bfw | wins / ties / losses |",
        "|---|---|---|---|---|",
    ]
    for (label, p_stages, text), p in sensitivity.items():
        lines.append(
            f"| {label} | {p_stages} | {text} | {p.mean:+.2f}% ± {p.stderr:.2f} | {p.wins} / {p.ties} / {p.losses} |"
        )
    return "\n".join([*lines, "", NOTES])


NOTES = """## Design notes (not regenerated by this script)

Measured while designing the rule with throwaway scripts (not in the repository): P=8, M=32, v=1,
cap 2x unless said, paired on the same traces, seeds 200-239 unless said; differences are in points
of makespan / stage window.

- **Critical-path ranking is the wrong principle here.** With expected durations per virtual stage
  and kind (the trace's means, as a profile gives), every microbatch of one (stage, kind) has the
  same remaining path, so ranking by it only orders kinds: F (its path runs to the loss and back)
  before B before W, i.e. forward-first under the cap. That is slower than bf and bfw everywhere
  (+0.5 to +1.4 unsplit, +0.2 to +0.8 split). Even with the exact future durations (an oracle, not a
  policy), ranking microbatches by their true remaining path is within noise of bf unsplit except
  multimodal (-1 to -3, seeds 200-229) and clearly worse than bfw split (+1 to +8.5). One
  microbatch's critical path is 0.17 to 0.35 of the stage-window bound at M = 4P: the iteration is
  bound by stage work and memory, not by a dependency path.
- **BF's F/B alternation is a robust local optimum.** Every variant tried was worse or within noise:
  forward-first below a target F->B depth of 1x, 1.5x, 2x 1F1B's (unsplit +0.5 to +8.5, split -0.3
  to +0.8), backward-first when this stage holds as many of the upstream stage's microbatches as its
  cap (identical at the exact cap, worse below it), forward-first in the drain (0 to +0.4),
  forward-first on stage 0 only (0 to -0.05, within noise), FIFO / LIFO / newest-microbatch-first
  orders (within noise over 60 seeds), and, unsplit, the backward that frees a held admission (what BF already
  runs at v=1; no change at v=2). So there is no unsplit `cp`: its rule would be `bf`.
- **Where bfw still loses** (multimodal, against the stage-window bound of the binding stage): 3.2%
  start delay (the bound assumes the lightest microbatch goes first, which no non-clairvoyant policy
  knows), 3.0% idle in the middle (the binding stage starved with no W left), 1.8% tail. For bf:
  3.4%, 8.2% and 10.6%.
- **Headroom.** A local search over per-stage priority lists that knows the trace (an oracle), started
  from bfw's schedule, reaches 1.097 -> 1.073 on lognormal 0.6 seed 2 and 1.095 -> 1.049 on
  multimodal seed 2; from bf's, lognormal 0.6 seed 0 at cap inf 1.19 -> 1.07 to 1.10. On multimodal
  seed 3 (one microbatch with 6x the load) bfw's 1.19 only falls to 1.18: under the 2x cap stage 0
  must wait for that microbatch's backward, so the stage-window bound, which ignores caps, is out
  of reach there.
- **Memory is the lever that is left.** With cap inf bfw gains 1.5 to 2 points on lognormal 0.6 and
  multimodal. cpw takes the part of that which needs no extra memory: an admission held only because
  a W has not run yet. Raising the deeper stages' caps to stage 0's (the same per-device peak, more
  activation memory in total) gave bf 1.3 points on lognormal 0.6 and nothing on multimodal; not used.
"""


if __name__ == "__main__":
    main()
