"""The GPT on Ray: one iteration's gradients equal the unsplit model's, and the job trains (its main() here)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gradients import gpt_reference

import train_gpt
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_workload
from rrfp_ray.train.partition import partition
from rrfp_ray.train.workload import ModelExecutor, ModelWorkload

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "n_layer": 4,
    "n_embd": 32,
    "n_head": 4,
    "block_size": 16,
    "tie_embeddings": False,
}  # driven without a Trainer: no tie groups


@dataclass(frozen=True)
class _Capturing:
    """A workload whose stages put (stage, gradients) on `sink` (a ray.util.queue.Queue) just before each step."""

    inner: ModelWorkload
    sink: object

    def executor(self, *, stage, layout):
        return _CapturingExecutor(inner=self.inner.executor(stage=stage, layout=layout), sink=self.sink)

    def latency(self, message, *, iteration):
        return self.inner.latency(message, iteration=iteration)

    @property
    def ties(self):
        return self.inner.ties

    def with_ties(self, *, reduce):
        return _Capturing(inner=self.inner.with_ties(reduce=reduce), sink=self.sink)


class _CapturingExecutor:
    def __init__(self, *, inner: ModelExecutor, sink) -> None:
        self.inner, self.sink = inner, sink

    def begin(self, *, args):
        self.inner.begin(args=args)

    def run(self, **kwargs):
        return self.inner.run(**kwargs)

    def finish(self, **kwargs):
        self.sink.put((self.inner.stage, [p.grad.clone() for p in self.inner.runner.parameters()]))
        return self.inner.finish(**kwargs)


@pytest.mark.parametrize(
    "links", [pytest.param("gloo", marks=pytest.mark.slow), "tcp"]
)  # gloo: the slow tier, for time
def test_gradients_on_ray_equal_the_unsplit_model(ray_session, links):
    ray = ray_session
    from ray.util.queue import Queue

    from actors.driver import PipelineDriver

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    run = RunConfig(
        model=TINY,
        pipeline={"stages": 2, "microbatches": 4, "timeout_s": 30, "backend": links},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 3},
    )
    loss, layers = gpt_reference(run)
    parts = partition(n_layers=len(layers), parts=2)
    sink = Queue()
    driver = PipelineDriver.remote(pipeline=run.pipeline, workload=_Capturing(inner=gpt_workload(run), sink=sink))
    try:
        for name in ("1f1b", "bfw"):
            ray.get(driver.set_workload.remote(workload=_Capturing(inner=gpt_workload(run), sink=sink)))
            report = ray.get(driver.run_iteration.remote(iteration=0, policy=run.pipeline.resolved_policy(name)))
            assert report.loss == pytest.approx(loss, rel=1e-5)
            grads = dict(sink.get(timeout=30) for _ in range(2))
            for stage in range(2):
                expected = [p.grad for i in parts[stage] for p in layers[i].parameters()]
                assert len(grads[stage]) == len(expected)
                for got, want in zip(grads[stage], expected):
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        ray.get(driver.shutdown.remote())
    finally:
        ray.kill(driver)
        sink.shutdown()


def test_train_gpt_job_trains(ray_session, tmp_path, monkeypatch, capsys, job_logging):
    """The job's main() on the session's Ray (the embedded start: tests/test_local_ray.py; the job as a process:
    tests/test_bad_input.py)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    flags = "--iterations 10 --stages 2 --microbatches 4 --micro-batch-size 4 --seq-len 32 --t-f 2 --no-compare"
    train_gpt.main([*flags.split(), "--out", str(tmp_path)])
    assert "attached to the running Ray" in capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    keys = {"policy", "iterations", "loss_first", "loss_last", "val_loss_last", "iteration_ms_median", "tokens_per_s"}
    assert keys <= summary.keys()
    assert summary["iterations"] == 10
    assert summary["loss_last"] < summary["loss_first"]
