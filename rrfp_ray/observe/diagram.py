"""Pipeline diagrams as PNG: a stages x time Gantt chart of one iteration, or two stacked on one time axis.

matplotlib is imported inside the functions, so importing this module stays cheap.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rrfp_ray.observe.perfetto import blocked_spans
from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.schedule.actions import Kind, parse_action

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

COLOURS = {Kind.F: "#3B75AF", Kind.I: "#E1812C", Kind.W: "#3A923A", Kind.B: "#C0504D"}
KIND_NAMES = {Kind.F: "F forward", Kind.I: "I input grad", Kind.W: "W weight grad", Kind.B: "B full backward"}
BLOCKED_FACE, BLOCKED_HATCH = "#F0F0F0", "#B0B0B0"
OVERTOOK_EDGE = "#000000"
WIDTH_IN, DPI, LABEL_PT = 13.0, 110, 7.5
_AXES_WIDTH_IN = WIDTH_IN - 1.2  # less the stage labels and margins: where the time axis lies
_BAR_HEIGHT = 0.8


def pipeline_png(path: str | Path, report: IterationReport, *, title: str | None = None) -> Figure:
    """Write one iteration's chart to `path`; returns the figure."""
    fig = _figure(rows=len(report.stages) + 2.5)
    _draw_axis(fig.subplots(), report, title=title or _title(report), xmax=report.makespan_ms)
    _legend(fig)
    fig.savefig(path)
    return fig


def compare_png(path: str | Path, top: IterationReport, bottom: IterationReport) -> Figure:
    """Write `top` above `bottom` on one time axis (up to the larger makespan); returns the figure."""
    fig = _figure(rows=len(top.stages) + len(bottom.stages) + 4.5)
    xmax = max(top.makespan_ms, bottom.makespan_ms)
    axes = fig.subplots(nrows=2, sharex=True)
    for ax, report in zip(axes, (top, bottom)):
        _draw_axis(ax, report, title=_title(report), xmax=xmax)
    axes[0].tick_params(labelbottom=True)
    axes[0].set_xlabel("")
    _legend(fig)
    fig.savefig(path)
    return fig


def _figure(*, rows: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError("pipeline diagrams need matplotlib: pip install 'rrfp-ray[plots]'") from error

    fig = Figure(figsize=(WIDTH_IN, 0.4 * rows), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _title(report: IterationReport) -> str:
    return (
        f"{report.policy}, iteration {report.iteration}: makespan {report.makespan_ms:.1f} ms, "
        f"bubble {report.bubble:.1%}, {sum(e.overtook for e in report.events)} overtakes"
    )


def _draw_axis(ax: Axes, report: IterationReport, *, title: str, xmax: float) -> None:
    """Stage s is the row at y = s, top to bottom; blocked time hatched, overtaking ops edged in black."""
    if xmax <= 0:
        raise ValueError(f"report {report.iteration}: makespan_ms must be > 0 to draw a time axis, got {xmax}")
    stages = [s.stage for s in report.stages]
    for stage in stages:
        spans = [(start, end - start) for start, end in blocked_spans(report, stage=stage)]
        ax.broken_barh(
            spans,
            (stage - _BAR_HEIGHT / 2, _BAR_HEIGHT),
            facecolor=BLOCKED_FACE,
            edgecolor=BLOCKED_HATCH,
            hatch="///",
            linewidth=0,
        )
    px_per_ms = _AXES_WIDTH_IN * DPI / xmax
    for event in report.events:
        action, width = parse_action(event.action, stages=len(stages)), event.end_ms - event.start_ms
        edge, line = (OVERTOOK_EDGE, 1.6) if event.overtook else ("white", 0.6)
        ax.broken_barh(
            [(event.start_ms, width)],
            (event.stage - _BAR_HEIGHT / 2, _BAR_HEIGHT),
            facecolor=COLOURS[action.kind],
            edgecolor=edge,
            linewidth=line,
        )
        chunk = action.virtual_stage // len(stages)  # the chunk under either placement
        label = str(action.microbatch) if chunk == 0 else f"{action.microbatch}c{chunk}"
        if width * px_per_ms > (len(label) * 0.65 * LABEL_PT + 4) * DPI / 72:
            ax.text(
                event.start_ms + width / 2,
                event.stage,
                label,
                ha="center",
                va="center",
                fontsize=LABEL_PT,
                color="white",
                fontweight="bold",
            )
    ax.set_xlim(0, xmax)
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.6)
    ax.set_axisbelow(True)


def _legend(fig: Figure) -> None:
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=COLOURS[k], edgecolor="white", label=KIND_NAMES[k]) for k in Kind]
    handles.append(Patch(facecolor=BLOCKED_FACE, edgecolor=BLOCKED_HATCH, hatch="///", label="blocked (idle)"))
    overtook = Patch(facecolor="#CCCCCC", edgecolor=OVERTOOK_EDGE, linewidth=1.6, label="overtook an earlier hint op")
    handles.append(overtook)
    fig.legend(handles=handles, loc="outside upper center", ncols=len(handles), frameon=False, fontsize=9)
