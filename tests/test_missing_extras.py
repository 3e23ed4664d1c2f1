"""Without an optional extra (its modules made unimportable here, as on a core install), a job
writes everything else, says in one line what it skipped and why, and exits 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("matplotlib", "tqdm", "tensorboard", "selenium", "cupy", "transformers")  # pyproject's extras, as imported
NO_PLOTS = "matplotlib is not installed (pip install 'rrfp-ray[plots]')"

# `python -c BLOCKED MODULES JOB ARGS...`: the job as `python JOB ARGS...` runs it, with MODULES
# (comma-separated) unimportable
BLOCKED = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = sys.argv[2:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _without(modules: tuple[str, ...], job: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED, ",".join(modules), str(ROOT / "jobs" / job), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=500,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_the_blocking_works():
    done = _without(("matplotlib",), "simulate.py", "--help")
    assert done.returncode == 0, done.stderr
    code = "import sys\nsys.modules['matplotlib'] = None\nimport matplotlib\n"
    assert subprocess.run([sys.executable, "-c", code], check=False, capture_output=True).returncode != 0


def test_simulate_without_matplotlib_writes_the_traces_and_says_it_skipped_the_diagrams(tmp_path):
    done = _without(("matplotlib",), "simulate.py", "--stages", "2", "--microbatches", "4", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines().count(f"diagrams skipped: {NO_PLOTS}") == 1, done.stdout
    assert f"wrote traces to {tmp_path}/" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json")  # the Perfetto traces
    assert not list(tmp_path.glob("*.png"))


def test_results_without_matplotlib_renders_the_report_and_says_it_skipped_the_plots(tmp_path):
    out, plots = tmp_path / "RESULTS.md", tmp_path / "plots"
    suite = str(ROOT / "docs" / "results" / "suite.json")
    done = _without(("matplotlib",), "results.py", "--json", suite, "--out", str(out), "--plots", str(plots))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"plots skipped: {NO_PLOTS}", done.stdout
    assert done.stdout.splitlines()[-1] == f"wrote {out} and 0 plot(s) under {plots}"
    assert "python jobs/results.py" in out.read_text() and "![" not in out.read_text()
    assert not plots.exists() or not list(plots.iterdir())


def test_every_job_starts_without_any_optional_extra():
    """`--help` of every job with every extra unimportable: no job imports an extra at its top."""
    code = (
        "import contextlib, io, runpy, sys\n"
        f"for name in {EXTRAS!r}:\n"
        "    sys.modules[name] = None\n"
        "sys.path.insert(0, 'jobs')\n"
        "failed = []\n"
        f"for job in {sorted(p.name for p in (ROOT / 'jobs').glob('*.py'))!r}:\n"
        "    sys.argv = ['jobs/' + job, '--help']\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(io.StringIO()):\n"
        "            runpy.run_path('jobs/' + job, run_name='__main__')\n"
        "    except SystemExit as exited:\n"
        "        if exited.code not in (0, None):\n"
        "            failed.append(f'{job}: exit {exited.code}')\n"
        "    except Exception as error:\n"
        "        failed.append(f'{job}: {error!r}')\n"
        "print('\\n'.join(failed))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "", done.stdout


@pytest.mark.slow  # an embedded Ray of its own
def test_train_gpt_without_matplotlib_and_tqdm_trains_writes_the_rest_and_exits_0(tmp_path):
    tiny = ["--stages", "2", "--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "16"]
    tiny += ["--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2", "--iterations", "2"]
    tiny += ["--val-every", "0", "--no-compare", "--policy", "bf", "--scenario", "none", "--out", str(tmp_path)]
    done = _without(("matplotlib", "tqdm"), "train_gpt.py", *tiny)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count(f"diagrams skipped: {NO_PLOTS}") == 1, done.stdout
    assert lines.count("progress bars skipped: tqdm is not installed (pip install 'rrfp-ray[jobs]')") == 1
    assert json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "trace-bf.json").is_file() and (tmp_path / "telemetry-bf.jsonl").is_file()
    assert not list(tmp_path.glob("*.png"))
    assert lines[-1].startswith(f"wrote {tmp_path}/: summary.json, telemetry, Perfetto traces (")
