"""The PNG diagrams: valid images, the marks they promise, and a shared time axis when compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from rrfp_ray.observe.diagram import compare_png, pipeline_png
from rrfp_ray.observe.telemetry import IterationReport, StageStats
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REPO_ROOT = Path(__file__).resolve().parents[1]


def report_for(name: str) -> IterationReport:
    trace = generate(scenario="multimodal", stages=4, microbatches=8, chunks=1, seed=0)
    policy = make_policy(name=name, stages=4, chunks=1, microbatches=8)
    return simulate(policy=policy, trace=trace, cap=Cap.parse("2x"))


@pytest.fixture(scope="module")
def bf() -> IterationReport:
    return report_for("bf")


def assert_png(path: Path, *, size: tuple[int, int]) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.load()
        assert image.size == size
        assert min(image.size) > 0


def pixel_size(fig) -> tuple[int, int]:
    width, height = fig.get_size_inches() * fig.dpi
    return round(width), round(height)


def test_importing_the_module_does_not_import_matplotlib():
    code = "import sys, rrfp_ray.observe.diagram; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pipeline_png_writes_a_readable_chart_with_every_mark(bf, tmp_path):
    path = tmp_path / "bf.png"
    fig = pipeline_png(path, bf, title="my title")
    assert_png(path, size=pixel_size(fig))
    (ax,) = fig.axes
    assert ax.get_title(loc="left") == "my title"
    assert ax.get_xlim() == pytest.approx((0.0, bf.makespan_ms))
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"stage {s.stage}" for s in bf.stages]
    boxes = [c for c in ax.collections if not c.get_hatch()]
    assert len(boxes) == len(bf.events)
    assert sum(c.get_linewidth()[0] > 1 for c in boxes) == sum(e.overtook for e in bf.events) > 0
    assert len({tuple(c.get_facecolor()[0]) for c in boxes}) == 2  # F and B (bf does not split W)
    assert any(c.get_hatch() for c in ax.collections)  # blocked time is drawn
    labels = [t.get_text() for t in ax.texts]
    assert 0 < len(labels) <= len(bf.events)
    assert set(labels) <= {str(m) for m in range(8)}
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert {"F forward", "I input grad", "W weight grad", "B full backward", "blocked (idle)"} <= set(legend)


def test_compare_png_stacks_two_charts_on_one_time_axis(bf, tmp_path):
    fixed = report_for("1f1b")
    path = tmp_path / "compare.png"
    fig = compare_png(path, fixed, bf)
    assert_png(path, size=pixel_size(fig))
    top, bottom = fig.axes
    span = (0.0, max(fixed.makespan_ms, bf.makespan_ms))
    assert top.get_xlim() == pytest.approx(span)
    assert bottom.get_xlim() == pytest.approx(span)
    assert top.get_shared_x_axes().joined(top, bottom)
    for ax, report in ((top, fixed), (bottom, bf)):
        title = ax.get_title(loc="left")
        assert title.startswith(report.policy)
        assert f"{report.makespan_ms:.1f} ms" in title


def test_an_empty_time_axis_is_refused(tmp_path):
    stages = [StageStats(stage=0, wall_ms=0.0, compute_ms=0.0, blocked_ms=0.0)]
    empty = IterationReport(iteration=2, policy="bf", makespan_ms=0.0, stages=stages)
    with pytest.raises(ValueError, match="makespan_ms"):
        pipeline_png(tmp_path / "empty.png", empty)
