"""An error of ours that reaches a job ends it with one line and no traceback: exit 2 for bad
input (a checkpoint the stages refuse included), exit 1 for a run that failed; the job's
debug log level adds the traceback. In-process pipelines here; tests/test_job_errors_ray.py
runs jobs/train_gpt.py itself on Ray."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rrfp_ray.errors import BadInput, ExitCode, RunFailed, exit_code_of
from rrfp_ray.runtime.errors import PipelineError, joint_exit_code

ROOT = Path(__file__).resolve().parents[1]

# A job on an in-process pipeline: `refused` resumes from a checkpoint one of whose stage files
# was replaced by a pickle carrying code (the manifest's digest updated to match); `crash` loses
# a stage with no restart left. Argument 3 `debug`: the library logs at debug, as --log-level debug sets it.
JOB = """
import logging, sys
from dataclasses import replace
from pathlib import Path
import torch
from torch import nn
from rrfp_ray import InMemoryData, PipelineConfig, Trainer
from rrfp_ray.job import run_job
from rrfp_ray.train.checkpoint import Checkpointing, commit, latest, save_stage

class Payload:
    def __reduce__(self):
        return (open, (sys.argv[2] + "/planted", "w"))

class Crash:
    def __init__(self, inner):
        self.inner = inner
    def __getattr__(self, name):
        return getattr(self.inner, name)
    def run(self, **kwargs):
        raise RuntimeError("injected crash")

def trainer(*, resume, max_restarts=0):
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(8)]
    return Trainer(
        model=lambda: [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)],
        loss_fn=nn.functional.mse_loss,
        data=InMemoryData(batches=batches, microbatches=4),
        pipeline=PipelineConfig(stages=2, microbatches=4, timeout_s=5.0),
        checkpoints=Checkpointing(directory=sys.argv[2], every=2, resume=resume, max_restarts=max_restarts),
    )

def main():
    if sys.argv[3:] == ["debug"]:
        logging.basicConfig()
        logging.getLogger("rrfp_ray").setLevel("DEBUG")
    if sys.argv[1] == "refused":
        with trainer(resume=False) as first:
            first.fit(2)
            directory = Path(first.checkpoints.directory)
            manifest = latest(directory=directory, fingerprint=first.fingerprint)
        tampered = save_stage(directory=directory, iteration=2, stage=1, state={"w": torch.zeros(1), "x": Payload()})
        files = {**manifest.files, 1: replace(manifest.files[1], sha256=tampered.sha256)}
        commit(directory=directory, manifest=replace(manifest, files=files))
        with trainer(resume=True) as again:
            again.fit(2)
    else:
        with trainer(resume=False) as run:
            run.backend.executors = [run.backend.executors[0], Crash(run.backend.executors[1])]
            run.fit(2)

run_job(main, program="job.py")
"""


def _job(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(script), args[0], str(tmp_path), *args[1:]],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )


def test_a_refused_checkpoint_on_resume_ends_the_job_with_exit_2_and_one_line(tmp_path):
    done = _job(tmp_path, "refused")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("job.py: error: stage 1 failed during checkpoint load: checkpoint file ")
    assert "stage-1.pt holds objects other than tensors and plain data (io.open), so it was refused unread" in lines[0]
    assert not (tmp_path / "planted").exists()


def test_the_debug_log_level_adds_the_traceback(tmp_path):
    done = _job(tmp_path, "refused", "debug")
    assert done.returncode == 2, done.stderr
    assert "Traceback" in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("job.py: error: stage 1 failed during checkpoint load")


def test_a_run_that_failed_past_its_restarts_ends_the_job_with_exit_1_and_no_traceback(tmp_path):
    done = _job(tmp_path, "crash")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("job.py: error: iteration 0 failed after 0 restart(s): "), done.stderr
    assert "injected crash" in done.stderr


def test_the_error_classes_carry_their_exit_code():
    from rrfp_ray.train.checkpoint import CheckpointError

    assert isinstance(CheckpointError("x"), BadInput) and isinstance(CheckpointError("x"), ValueError)
    assert exit_code_of(CheckpointError("x")) is ExitCode.BAD_INPUT
    assert isinstance(PipelineError("x"), RunFailed) and exit_code_of(PipelineError("x")) is ExitCode.RUN_FAILED
    assert exit_code_of(ValueError("not ours")) is ExitCode.RUN_FAILED
    assert exit_code_of(None) is ExitCode.RUN_FAILED  # a stage that died or did not answer


@pytest.mark.parametrize(
    ("causes", "expected"),
    [
        ([BadInput("refused")], ExitCode.BAD_INPUT),
        ([BadInput("refused"), BadInput("refused too")], ExitCode.BAD_INPUT),
        ([BadInput("refused"), None], ExitCode.RUN_FAILED),  # another stage died: the run failed
        ([BadInput("refused"), RuntimeError("a bug")], ExitCode.RUN_FAILED),
        ([], ExitCode.RUN_FAILED),
    ],
)
def test_stage_failures_are_bad_input_only_when_every_one_is(causes, expected):
    assert joint_exit_code(causes) is expected


def test_a_pipeline_error_keeps_its_exit_code_through_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(PipelineError("refused", culprit="stage 1 failed", exit_code=ExitCode.BAD_INPUT)))
    assert (str(error), error.culprit, error.exit_code) == ("refused", "stage 1 failed", ExitCode.BAD_INPUT)


@pytest.mark.parametrize("path", sorted((ROOT / "jobs").glob("*.py")), ids=lambda p: p.name)
def test_every_job_runs_its_main_through_run_job(path: Path):
    tree = ast.parse(path.read_text())
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and ast.unparse(guard.test) == "__name__ == '__main__'", path.name
    assert [ast.unparse(statement) for statement in guard.body] == ["run_job(main)"], path.name
