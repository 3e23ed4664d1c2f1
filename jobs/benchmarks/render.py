"""docs/RESULTS.md as text, from the suite's JSON read back: the claims table, the target,
setup, runtime, TP, simulator and buffer sections, the plot links and the run log."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from benchmarks.attribution import attribution_section, seed_text
from benchmarks.claims import claims
from benchmarks.pytorch_target import target_section
from benchmarks.ray_attribution import ray_attribution_section
from benchmarks.report import ROOT, SUITE, Suite, missing, pct, table, x
from benchmarks.rows import FidelityRow, SimRow

PARTS = ("sim", "buffer", "runtime", "peers", "tp", "fidelity")  # the JSON's sections, in the order they run


def claims_section(suite: Suite) -> list[str]:
    rows = [(c.claim, c.measures, c.where, c.result, c.verdict) for c in claims(suite)]
    return [
        "## The paper's claims",
        "",
        *table(("claim", "what rrfp-ray measures", "where", "result", "reproduces?"), rows),
    ]


def runtime_section(suite: Suite) -> list[str]:
    lines = ["## Ray runtime (M = 4P): measured against the simulator", ""]
    if not suite.runtime:
        return lines + [missing("runtime") + "."]
    section = suite.data["runtime"]
    seeds = sorted({r.seed for r in suite.runtime})
    lines += [
        f"Synthetic sleep workload, seeds {', '.join(map(str, seeds))}, {section['warmup']} warm-up + "
        f"{section['iterations']} timed iterations per run and seed, runs taking turns; per seed the median, then "
        "the median over seeds (the optimizer step inside every iteration's time, as in telemetry and "
        "train_gpt's line). *sim* is the simulator on the very same traces, cap and buffer "
        "limit (32). Speedup is over rrfp-ray's own fixed 1f1b, measured. Memory: peak activations over fixed "
        "1F1B's, from the measured op timeline. A readiness run can beat its simulation (meas / sim < 1): the "
        "arbiters decide on the measured times, so their order is not the simulated one.",
        "",
    ]
    if section.get("errors"):
        lines += ["Failures: " + "; ".join(section["errors"]), ""]
    body = []
    for scenario, p in ((s, p) for p in suite.ray_stages for s in suite.scenarios):
        rows = suite.runtime_rows(scenario=scenario, stages=p)
        base = next((r.measured_ms for r in rows if r.run == "1f1b"), None)
        for r in rows:
            body.append(
                [
                    scenario,
                    p,
                    r.run,
                    f"{r.measured_ms:.0f}",
                    f"{r.sim_ms:.0f}",
                    f"{r.measured_ms / r.sim_ms:.3f}",
                    x(base / r.measured_ms) if base else "-",
                    pct(r.blocked_fraction),
                    x(r.memory_x),
                    r.peak_inflight,
                ]
            )
    header = (
        "scenario",
        "P",
        "run",
        "measured ms",
        "sim ms",
        "meas / sim",
        "speedup vs 1f1b",
        "blocked",
        "memory",
        "peak in-flight",
    )
    return lines + table(header, body)


def tp_section(suite: Suite) -> list[str]:
    if not suite.tp:
        return []
    section = suite.data["tp"]
    lines = [
        "## TP agreement (PP=2 x TP=2, M=8, t_f=20 ms)",
        "",
        (
            "Ray, synthetic sleep workload, "
            f"{section['warmup']} warm-up + {section['iterations']} timed iterations per "
            "run, runs taking turns; one driver per protocol and one without TP (TP=1); median ms. Telemetry of rank 0 "
            "of each stage. Coordination: per agreement round, the time from the last rank joining it to the result, "
            "over the stages' wall time (median over iterations); fixed 1f1b runs the same list on every rank and "
            "needs no rounds. Every rank computes the seed-0 trace, its F and B ops in step with the other rank (an "
            "op ends its duration after the later rank started it, as the TP collectives inside real ops make it; "
            "W ops run on their own); on lognormal-0.3 both ranks also share the trace's "
            "message latencies, on the comm scenarios each rank's messages take their own (rank t's drawn with seed "
            "t), so the ranks' ready sets can differ. A disagreement is a round that decided nothing although a rank "
            "offered an op."
        ),
        "",
    ]
    if section.get("errors"):
        lines += ["Failures: " + "; ".join(section["errors"]), ""]
    cells = list(dict.fromkeys((r.scenario, r.run) for r in suite.tp))
    body = []
    for r in sorted(suite.tp, key=lambda r: cells.index((r.scenario, r.run))):  # the protocols of a run together
        agreed, tp = r.tp_rounds > 0, r.tp > 1
        body.append(
            [
                r.scenario,
                r.run,
                r.protocol.value if tp else "TP=1",
                f"{r.measured_ms:.0f}",
                "-" if r.vs_tp1 is None else x(r.vs_tp1),
                pct(r.tp_coord_fraction, digits=2) if tp else "-",
                f"{r.tp_rounds:.1f}" if tp else "-",
                f"{r.tp_ms_per_round:.3f}" if agreed else "-",
                f"{r.disagreements_per_round:.3f}" if agreed else "-",
            ]
        )
    header = (
        "scenario",
        "run",
        "protocol",
        "median ms",
        "vs TP=1",
        "coordination, % of stage time",
        "rounds/iteration",
        "ms/round",
        "disagreements per round",
    )
    return lines + table(header, body)


def _fixed_1f1b(row: FidelityRow, rows: list[FidelityRow]) -> FidelityRow | None:
    """The fidelity part's 1f1b row at the same P."""
    return next((b for b in rows if (b.stages, b.policy) == (row.stages, "1f1b")), None)


def _contention(rows: list[FidelityRow], suite: Suite) -> str:
    """How much longer the same ops took under each readiness policy than under 1f1b, per P."""
    ratios = []
    for r in rows:
        base = _fixed_1f1b(r, rows)
        if base is not None and r is not base:
            ratios.append(f"{r.op_ms_mean / base.op_ms_mean - 1:+.0%} under {r.policy} at P={r.stages}")
    return (
        f"The P stage threads share one interpreter and the machine's CPUs ({suite.meta['machine']}), so ops "
        "that run at the same time slow each other: the same ops took "
        + (", ".join(ratios) or "-")
        + " against 1f1b, and the *vs 1f1b* column carries that contention as well as the order."
    )


def fidelity_section(suite: Suite) -> list[str]:
    section = suite.data.get("fidelity")
    if not section:
        return []
    lines = [
        "## Fidelity on real ops: a GPT run replayed in the simulator",
        "",
        f"The default GPT on `--varlen` data with no injected sleeps, in one process (the in-process backend: a "
        f"thread per stage, in-memory links), {section['warmup']} warm-up + {section['iterations']} timed "
        "iterations per policy, M = 4P, medians. Each timed iteration's ops' measured durations and messages' "
        "measured transits make a trace (`rrfp_ray/sim/replay.py`; `python jobs/replay.py TELEMETRY` does the "
        "same for any run's telemetry); the simulator runs the same policy and cap on it. *measured* leaves the "
        "optimizer step out, as the simulator does; *iteration* has it. " + _contention(suite.fidelity, suite),
        "",
    ]
    body = []
    for r in suite.fidelity:
        base = _fixed_1f1b(r, suite.fidelity)
        body.append(
            [
                r.stages,
                r.policy,
                f"{r.measured_ms:.0f}",
                f"{r.schedule_ms:.0f}",
                f"{r.simulated_ms:.0f}",
                f"{r.sim_over_measured:.3f}",
                f"{r.op_ms_mean:.1f}",
                "-" if base is None else x(base.measured_ms / r.measured_ms),
            ]
        )
    header = ("P", "policy", "iteration ms", "measured ms", "replayed ms", "sim / meas", "ms per op", "vs 1f1b")
    return lines + table(header, body)


def sim_section(suite: Suite) -> list[str]:
    lines = ["## Simulator (M = 4P)", ""]
    if not suite.sim:
        return lines + [missing("sim") + "."]
    lines += [
        f"Means over {seed_text(suite)}; peaks are the maximum over seeds. Speedup over fixed 1f1b on the same "
        "trace; in parentheses the peak activation memory over fixed 1F1B's. Fixed schedules ignore caps.",
        "",
        "### Speedup over fixed 1F1B (memory)",
        "",
    ]
    chunks = {r.run: r.chunks for r in suite.sim}
    groups = [[run for run in suite.runs if chunks[run] == v] for v in sorted(set(chunks.values()))]

    def grid(cell: Callable[[SimRow], str]) -> list[str]:
        out = []
        for runs in groups:  # one table per v, so that each stays readable
            body = []
            for scenario in suite.scenarios:
                for p in suite.stages:
                    cells = [suite.cell(scenario=scenario, stages=p, run=run) for run in runs]
                    if any(c is not None for c in cells):
                        body.append([scenario, p, *(cell(c) if c else "-" for c in cells)])
            out += [f"v={chunks[runs[0]]}:", "", *table(["scenario", "P", *runs], body), ""]
        return out

    lines += grid(lambda c: f"{c.speedup_vs_1f1b:.3f} ({c.memory_x:.2g})")
    lines += ["### Makespan / lower bound", ""]
    lines += grid(lambda c: f"{c.lb_ratio:.3f}")
    lines += ["### Blocked fraction / peak in-flight microbatches (any stage)", ""]
    lines += grid(lambda c: f"{pct(c.blocked_fraction)} / {c.peak_inflight}")
    return lines


def buffer_section(suite: Suite) -> list[str]:
    lines = ["## Receive-buffer limit (bf)", ""]
    if not suite.buffer:
        return lines + [missing("sim") + "."]
    limits = list(dict.fromkeys(r.buffer_limit for r in suite.buffer))
    lines += [
        f"Makespan with each stage's receive buffer limited to N messages / unbounded, on "
        f"{suite.buffer[0].scenario}; mean (max) over seeds; *deadlock* counts seeds that deadlock. The "
        "arbiter's rule (rrfp_ray/policy/arbiter.py) says bf over 1f1b needs 3 at cap 2x and 1 at inf.",
        "",
    ]
    body = []
    for p, cap in dict.fromkeys((r.stages, r.cap) for r in suite.buffer):
        cells = []
        for limit in limits:
            r = next(b for b in suite.buffer if (b.stages, b.cap, b.buffer_limit) == (p, cap, limit))
            if r.makespan_rel is None:
                cells.append(f"deadlock ({r.deadlocks}/{r.seeds})")
            else:
                extra = f", {r.deadlocks} deadlock" if r.deadlocks else ""
                cells.append(f"{r.makespan_rel:.3f} ({r.makespan_rel_max:.3f}{extra})")
        peak = next(b.unbounded_peak_buffered for b in suite.buffer if (b.stages, b.cap) == (p, cap))
        body.append([p, cap, *cells, peak])
    header = ["P", "cap", *(f"N={'inf' if n is None else n}" for n in limits), "peak buffered, unbounded"]
    return lines + table(header, body)


def setup_section(suite: Suite) -> list[str]:
    meta = suite.meta
    scen = [
        [s["label"], f"`{s['scenario']}`", ", ".join(f"{k}={v:g}" for k, v in s["params"].items()) or "-"]
        for s in meta["scenarios"]
    ]
    return [
        "## Setup",
        "",
        f"- Work per op: forward t_f = {meta['t_f_ms']:g} ms per stage, backward B + W = {meta['b_ratio']:g} t_f "
        f"(W is {meta['w_split']:g} of it), before the scenario scales it (`rrfp_ray/sim/variability.py`).",
        f"- Fixed schedules (only the next op of the list may run): {fixed_runs(suite)}. Readiness rules: "
        f"{', '.join(suite.rules)}, at in-flight caps {', '.join(meta['caps'])}, and the ready-* lists (the first "
        "ready op of a schedule's list) at 1x and 2x (a cap is a multiple of the reference list's own per-stage "
        "peak, so 1x = fixed 1F1B's activation memory for v=1).",
        "- v=2 on the V placement (zbv, dualpipev) runs the same v=2 trace: stage s holds virtual stages s and "
        "2P-1-s, so its two halves come from two different v=1 stages.",
        "- Interleaved runs the same model: its v=2 trace is the v=1 trace with every op cut into two equal "
        "halves, one per chunk (t_f = 10 ms per chunk, the same work per stage and microbatch, the same random "
        "draws); only the latencies of its 2P-1 links are fresh draws of the same scenario and seed.",
        "- Memory: the most activations any stage holds, a microbatch-chunk counting 1/v from its forward's start "
        "to the end of its last backward op (W under the B/W split), over fixed 1F1B's peak (P).",
        "- Lower bound: `rrfp_ray.sim.bounds.bounds(...).best_ms` (with the B/W split for the policies that split "
        "the backward: zb-h1, bfw, cpw).",
        "",
        *table(("scenario", "generator", "parameters"), scen),
    ]


def fixed_runs(suite: Suite) -> str:
    rows = {r.run: r.chunks for r in suite.sim if r.cap is None}
    return ", ".join(f"{run} (v={chunks})" if chunks > 1 else run for run, chunks in rows.items())


def run_log(suite: Suite) -> list[str]:
    body = []
    for part in PARTS:
        section = suite.data.get(part)
        for run in (section.get("log") or [section]) if section else []:
            load = " -> ".join(f"{v:.1f}" for v in run["load_avg_1min"])
            code = run.get("commit", "not recorded")
            body.append([part, f"`{run['command']}`", code, run["finished"], f"{run['wall_s']:.0f} s", load])
    header = ("part", "command", "code", "finished", "wall", "1-min load, start -> end")
    return ["## Run log", "", *table(header, body)]


def plot_links(plots: dict[str, Path], *, out: Path) -> list[str]:
    lines = ["## Plots", ""]
    for title, path in plots.items():
        lines += [f"![{title}]({os.path.relpath(path, out.parent)})", ""]
    return lines


PLANNING = ROOT / "docs" / "results" / "planning.md"  # the planning benchmark's section (jobs/bench_planning.py)
REBALANCING = ROOT / "docs" / "results" / "rebalancing.md"  # the rebalancer in the simulator (jobs/bench_rebalance.py)
RUNTIME_COST = ROOT / "docs" / "results" / "runtime_cost.md"  # CPU per op and one message (bench_runtime --breakdown)
MULTIMODAL = ROOT / "docs" / "results" / "multimodal.md"  # the VLM on real compute (jobs/bench_vlm.py)


def written_section(path: Path) -> list[str]:
    """A section measured outside the suite, as written with the tables its job printed; none before it ran."""
    return path.read_text().rstrip().splitlines() if path.is_file() else []


def render(suite: Suite, *, source: Path, out: Path, plots: dict[str, Path]) -> str:
    meta = suite.meta
    total = sum(suite.data[p]["wall_s"] for p in PARTS if p in suite.data)
    quick = " (a `--quick` run: simulator only, P=4, two seeds, two scenarios)" if meta["quick"] else ""
    head = [
        "# rrfp-ray: results",
        "",
        f"Every number here comes from `{os.path.relpath(source, ROOT)}`{quick}, measured on {meta['machine']} "
        f"in {total / 60:.1f} min. To reproduce, from the repository root:",
        "",
        "```",
        f"{SUITE}        # measure: simulator, Ray runtime, PyTorch peers, TP agreement -> docs/results/suite.json",
        "python jobs/results.py            # render this file and docs/results/*.png from that JSON (seconds)",
        "```",
        "",
        f"`{SUITE} --parts runtime` (or sim, peers, tp) re-measures one part and keeps the others.",
        "",
    ]
    sections = [
        head,
        claims_section(suite),
        attribution_section(suite),
        target_section(suite),
        written_section(PLANNING),
        written_section(REBALANCING),
        written_section(MULTIMODAL),
        setup_section(suite),
        runtime_section(suite),
        ray_attribution_section(suite),
        tp_section(suite),
        fidelity_section(suite),
        written_section(RUNTIME_COST),
        sim_section(suite),
        buffer_section(suite),
        plot_links(plots, out=out),
        run_log(suite),
    ]
    return "\n".join(line for section in sections if section for line in [*section, ""]).rstrip() + "\n"
