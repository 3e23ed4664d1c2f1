"""The report's plots from the suite's JSON: speedup against activation memory, against depth,
and rrfp-ray vs PyTorch (PNGs, for the report jobs/results.py renders)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after matplotlib.use

from benchmarks.report import FIXED_COLORS, Suite

RULE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:cyan", "tab:olive")


def rule_style(*, index: int, count: int) -> dict[str, float]:
    """Later rules drawn thinner on top of earlier ones, so that equal curves all stay visible."""
    wider = count - 1 - index
    return {"lw": 1.2 + 1.3 * wider, "ms": 4.0 + 2.5 * wider}


def _grid(count: int) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(4, count)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows + 0.8), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[count:]:
        ax.set_visible(False)
    return fig, flat[:count]


def _finish(fig: plt.Figure, axes: list[plt.Axes], *, title: str, path: Path) -> Path:
    handles, labels = {}, []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    labels = list(handles)
    fig.suptitle(title)
    fig.legend(
        [handles[label] for label in labels], labels, loc="lower center", ncol=min(10, len(labels)), frameon=False
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_memory(suite: Suite, *, path: Path) -> Path:
    """Speedup over fixed 1F1B against activation memory, one panel per scenario, at one P."""
    p = 16 if 16 in suite.stages else suite.stages[-1]
    fig, axes = _grid(len(suite.scenarios))
    for ax, scenario in zip(axes, suite.scenarios):
        for i, (color, rule) in enumerate(zip(RULE_COLORS, suite.rules)):
            cells = [suite.cell(scenario=scenario, stages=p, run=f"{rule}@{cap}") for cap in suite.meta["caps"]]
            pts = [(c.memory_x, c.speedup_vs_1f1b, c.cap) for c in cells if c]
            style = rule_style(index=i, count=len(suite.rules))
            ax.plot(
                [q[0] for q in pts], [q[1] for q in pts], "o-", color=color, label=f"{rule} (caps 1x, 2x, inf)", **style
            )
            for mem, speed, cap in pts if i == 0 else ():  # the caps of the others sit at the same memory
                ax.annotate(cap, (mem, speed), textcoords="offset points", xytext=(4, -11), fontsize=7, color=color)
        for name, color in FIXED_COLORS.items():
            c = suite.cell(scenario=scenario, stages=p, run=name)
            if c:
                ax.plot([c.memory_x], [c.speedup_vs_1f1b], "s", color=color, label=f"fixed {name}")
        ax.axhline(1.0, color="black", lw=0.6, ls=":")
        ax.axvline(2.0, color="tab:red", lw=0.6, ls="--")
        ax.margins(x=0.08, y=0.15)
        ax.set_title(scenario, fontsize=10)
        ax.set_xlabel("peak activation memory / fixed 1F1B's")
        ax.set_ylabel("speedup over fixed 1F1B")
        ax.grid(alpha=0.3)
    title = f"Simulator, P={p}, M={4 * p}: speed against memory (dashed red: 2x 1F1B's memory)"
    return _finish(fig, axes, title=title, path=path)


def plot_depth(suite: Suite, *, path: Path) -> Path:
    """Speedup over fixed 1F1B against pipeline depth P, one panel per scenario."""
    runs = [f"{rule}@{cap}" for rule in suite.rules for cap in ("1x", "2x")] + ["zb-h1", "interleaved", "gpipe"]
    colors = {f"{rule}@{cap}": RULE_COLORS[i] for i, rule in enumerate(suite.rules) for cap in ("1x", "2x")}
    styles = {
        f"{r}@{cap}": rule_style(index=i, count=len(suite.rules))
        for i, r in enumerate(suite.rules)
        for cap in ("1x", "2x")
    }
    fig, axes = _grid(len(suite.scenarios))
    for ax, scenario in zip(axes, suite.scenarios):
        for run in runs:
            cells = [suite.cell(scenario=scenario, stages=p, run=run) for p in suite.stages]
            pts = [(c.stages, c.speedup_vs_1f1b) for c in cells if c]
            if not pts:
                continue
            xs, ys = [q[0] for q in pts], [q[1] for q in pts]
            if "@" in run:  # under the thin fixed lines, so that equal curves both show
                ax.plot(xs, ys, "o--" if run.endswith("@1x") else "o-", color=colors[run], label=run, **styles[run])
            else:
                ax.plot(xs, ys, "s-", color=FIXED_COLORS[run], lw=1.0, ms=4, label=f"fixed {run}")
        ax.axhline(1.0, color="black", lw=0.6, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(suite.stages, [str(p) for p in suite.stages])
        ax.minorticks_off()
        ax.margins(y=0.12)
        ax.set_title(scenario, fontsize=10)
        ax.set_xlabel("pipeline stages P (M = 4P)")
        ax.set_ylabel("speedup over fixed 1F1B")
        ax.grid(alpha=0.3)
    return _finish(fig, axes, title="Simulator: speedup against pipeline depth (dashed: cap 1x)", path=path)


def plot_target(suite: Suite, *, path: Path) -> Path | None:
    """Measured speedup over PyTorch's Schedule1F1B per scenario: PyTorch's schedules and rrfp-ray's runs."""
    scenarios = [s for s in suite.scenarios if suite.peer_rows(scenario=s) and suite.runtime_rows(scenario=s)]
    if not scenarios:
        return None
    bars = [("PyTorch", s) for s in ("1f1b", "interleaved", "zb-h1")]
    bars += [("rrfp-ray", r) for r in ("1f1b", "zb-h1", *(f"{rule}@2x" for rule in suite.rules))]
    fig, ax = plt.subplots(figsize=(min(18.0, max(8.0, 0.22 * len(scenarios) * len(bars) + 2)), 5.0))
    width = 0.8 / len(bars)
    colors = {**FIXED_COLORS, "1f1b": "dimgray", **{f"{r}@2x": c for r, c in zip(suite.rules, RULE_COLORS)}}
    for i, (who, name) in enumerate(bars):
        values = []
        for scenario in scenarios:
            peers = {r.schedule: r.measured_ms for r in suite.peer_rows(scenario=scenario)}
            ours = {r.run: r.measured_ms for r in suite.runtime_rows(scenario=scenario)}
            value = (peers if who == "PyTorch" else ours).get(name)
            values.append(peers["1f1b"] / value if value and "1f1b" in peers else 0.0)
        pytorch = who == "PyTorch"
        positions = [k + (i - (len(bars) - 1) / 2) * width for k in range(len(scenarios))]
        ax.bar(
            positions,
            values,
            width,
            label=f"{who} {name}",
            color=colors[name],
            alpha=0.55 if pytorch else 1.0,
            hatch="//" if pytorch else None,
            edgecolor="white",
        )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.set_xticks(range(len(scenarios)), scenarios, rotation=20, ha="right")
    ax.set_ylabel("speedup over PyTorch Schedule1F1B (measured)")
    low = min((b.get_height() for b in ax.patches if b.get_height() > 0), default=0.8)
    ax.set_ylim(max(0.0, min(0.8, low - 0.05)), None)
    ax.set_title("Ray runtime vs PyTorch pipelining, P=4, M=16, same traces (hatched: PyTorch)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(suite: Suite, *, directory: Path) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    if suite.sim:
        out["Speedup against activation memory"] = plot_memory(suite, path=directory / "speedup_vs_memory.png")
        out["Speedup against pipeline depth"] = plot_depth(suite, path=directory / "speedup_vs_depth.png")
    target = plot_target(suite, path=directory / "runtime_vs_pytorch.png")
    if target is not None:
        out["Ray runtime against PyTorch"] = target
    return out
