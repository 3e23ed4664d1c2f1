"""Data parallelism in one process: D replicas of the pipeline compute what one pipeline
computes on the global batch (D x M microbatches), whatever order their chunks finish in."""

from __future__ import annotations

import threading

import pytest
import torch
from gradients import GradCapture
from torch import nn

from examples.mlp import Regression, mlp
from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.runtime.reduce import ChunkGradients, GradReducer, buckets
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, tensor_all_reduce
from rrfp_ray.train.partition import partition

M = 2  # microbatches per replica


def _trainer(*, dp: int, microbatches: int, policy: str = "1f1b", chunks: int = 1, **pipeline) -> Trainer:
    config = PipelineConfig(
        stages=2, chunks=chunks, microbatches=microbatches, policy=policy, dp=dp, timeout_s=30, **pipeline
    )
    return Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=Regression(microbatches=dp * microbatches),
        pipeline=config,
        optimizer=Optim(lr=1e-2, warmup=0, total=10, max_grad_norm=0.05),  # the clip is active
    )


def _weights(trainer: Trainer) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in e.runner.parameters()] for e in trainer.backend.executors]


@pytest.mark.parametrize(("policy", "chunks"), [("1f1b", 1), ("bfw", 1), ("bf", 2), ("interleaved", 2)])
def test_every_replicas_gradients_equal_the_unsplit_models_on_the_global_batch(policy, chunks):
    with _trainer(dp=2, microbatches=M, policy=policy, chunks=chunks) as trainer:
        captures = [GradCapture(e) for e in trainer.backend.executors]
        trainer.backend.executors = captures
        report = trainer.step()
        model = trainer.workload.layers.model()
    data = Regression(microbatches=2 * M)
    batches = [data.microbatch(iteration=0, index=m) for m in range(2 * M)]
    loss = sum(nn.functional.mse_loss(model(x), y) for x, y in batches) / len(batches)
    loss.backward()
    parts = partition(n_layers=len(model), parts=2 * chunks)
    expected = [
        [w.grad for c in range(chunks) for i in parts[c * 2 + s] for w in model[i].parameters()] for s in range(2)
    ]
    assert report.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    assert len(captures) == 4  # 2 replicas x 2 stages
    for index, capture in enumerate(captures):
        want = expected[index % 2]
        assert len(capture.grads) == len(want) > 0
        for got, ref in zip(capture.grads, want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_dp_2_with_m_microbatches_trains_as_dp_1_with_2m(overlap):
    with _trainer(dp=2, microbatches=M, policy="bfw", dp_overlap=overlap, dp_bucket_mb=0.004) as split:
        split_losses = [r.loss for r in split.fit(4)]
        split_weights = _weights(split)
        stats = split.backend.run_iteration(iteration=4, policy=split.pipeline.resolved_policy("bfw")).stages
    with _trainer(dp=1, microbatches=2 * M, policy="bfw") as whole:
        whole_losses = [r.loss for r in whole.fit(4)]
        whole_weights = _weights(whole)
    assert split_losses == pytest.approx(whole_losses, rel=1e-5)
    assert split_losses[-1] < split_losses[0]
    for replica in range(2):
        for got_stage, want_stage in zip(split_weights[replica * 2 : replica * 2 + 2], whole_weights):
            for got, want in zip(got_stage, want_stage):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert sorted((s.replica, s.stage) for s in stats) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for s in stats:
        params = sum(p.numel() for p in split.workload.layers.model().parameters())
        assert 0 < s.reduce_bytes < params * 4  # a stage sums its own share of the weights' gradients
        assert 0 <= s.reduce_exposed_ms <= s.reduce_ms


def test_replicas_sum_their_chunks_in_one_order_whatever_order_they_finish_in():
    group = ThreadAllGather(parties=2, timeout_s=10)
    reducers = [
        GradReducer(
            all_reduce=tensor_all_reduce(group.member(r)), order=[1, 0], bucket_bytes=8, timeout_s=10, name=f"r{r}"
        )
        for r in range(2)
    ]
    grads = [{c: [torch.full((3,), 10.0 * r + c), torch.full((2,), 1.0 + r)] for c in range(2)} for r in range(2)]

    def replica(r: int, finish_order: list[int]) -> None:
        reducers[r].begin()
        for chunk in finish_order:
            reducers[r].submit(key=chunk, grads=ChunkGradients(tensors=grads[r][chunk]))
        reducers[r].wait()

    threads = [threading.Thread(target=replica, args=(0, [0, 1])), threading.Thread(target=replica, args=(1, [1, 0]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    for r in range(2):
        for chunk in range(2):
            torch.testing.assert_close(grads[r][chunk][0], torch.full((3,), 10.0 + 2 * chunk))
            torch.testing.assert_close(grads[r][chunk][1], torch.full((2,), 3.0))
        reducers[r].close()


def test_buckets_keep_the_order_and_stay_under_the_size():
    tensors = [torch.zeros(2), torch.zeros(3), torch.zeros(10), torch.zeros(1, dtype=torch.float64), torch.zeros(1)]
    groups = buckets(tensors, bucket_bytes=20)
    assert [[t.numel() for t in g] for g in groups] == [[2, 3], [10], [1], [1]]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"dp": 0}, "dp"),
        ({"dp_bucket_mb": 0}, "dp_bucket_mb"),
    ],
)
def test_bad_dp_config_names_the_field(overrides, expected):
    with pytest.raises(ValueError, match=expected):
        PipelineConfig(stages=2, microbatches=M, **overrides)


def test_a_data_source_not_holding_dp_x_m_microbatches_is_refused_naming_both():
    config = PipelineConfig(stages=2, microbatches=M, dp=2)
    with pytest.raises(
        ValueError, match=r"data.microbatches = 2 differs from the pipeline's dp x microbatches = 2 x 2 = 4"
    ):
        Trainer(model=mlp, loss_fn=nn.functional.mse_loss, data=Regression(microbatches=M), pipeline=config)


def test_a_crashed_stage_in_replica_1_rebuilds_every_replica_from_the_checkpoint(tmp_path):
    from rrfp_ray.train.checkpoint import Checkpointing

    def trainer(directory: str, *, max_restarts: int) -> Trainer:
        return Trainer(
            model=mlp,
            loss_fn=nn.functional.mse_loss,
            data=Regression(microbatches=2 * M),
            pipeline=PipelineConfig(stages=2, microbatches=M, policy="bf", dp=2, timeout_s=2.0),
            optimizer=Optim(lr=1e-2, warmup=0, total=10),
            checkpoints=Checkpointing(directory=directory, every=2, max_restarts=max_restarts),
        )

    class CrashOnce:
        def __init__(self, inner, *, at: int) -> None:
            self.inner, self.left = inner, at

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run(self, **kwargs):
            self.left -= 1
            if self.left == 0:
                raise RuntimeError("injected crash")
            return self.inner.run(**kwargs)

    with trainer(str(tmp_path / "clean"), max_restarts=0) as clean:
        clean.fit(5)
        expected = _weights(clean)
    with trainer(str(tmp_path / "crash"), max_restarts=1) as crashed:
        executors = crashed.backend.executors
        executors[3] = CrashOnce(executors[3], at=4 * 2 * M - 2)  # replica 1, stage 1, in iteration 3
        crashed.backend.executors = executors
        while crashed.iteration < 5:  # the iterations since the checkpoint run again
            crashed.step()
        assert crashed.restarts == 1
        got = _weights(crashed)
    assert len(got) == 4
    for got_stage, want_stage in zip(got, expected):
        for a, b in zip(got_stage, want_stage):
            torch.testing.assert_close(a, b)
