"""ZeRO-1 in one process: each replica receives the summed gradients of the parameters it owns
alone, and the optimizer state sharded over the DP replicas trains what the unsharded optimizer
trains, each replica holding about 1/D of the state; checkpoints hold (and restore) every replica's shard."""

from __future__ import annotations

import threading

import pytest
import torch
from gradients import GradCapture
from torch import nn

from examples.mlp import FEATURES, Regression
from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.observe.telemetry import IterationReport, dp_summary
from rrfp_ray.runtime.reduce import ChunkGradients, GradReducer, gather_owned, owners
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, tensor_all_reduce, tensor_reduce_to
from rrfp_ray.train.checkpoint import Checkpointing

M = 2  # microbatches per replica


def mlp() -> nn.Sequential:
    """Four equal layers a stage: whole tensors can balance the optimizer state over 2 replicas."""
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh()) for _ in range(7)], nn.Linear(FEATURES, 1)
    )


def _trainer(*, zero: int, directory: str | None = None, resume: bool = False, policy: str = "bfw") -> Trainer:
    return Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=Regression(microbatches=2 * M),
        pipeline=PipelineConfig(stages=2, microbatches=M, policy=policy, dp=2, zero=zero, timeout_s=30),
        optimizer=Optim(lr=1e-2, warmup=0, total=10, max_grad_norm=0.05),  # the clip is active
        checkpoints=None if directory is None else Checkpointing(directory=directory, every=0, resume=resume),
    )


def _weights(trainer: Trainer) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in e.runner.parameters()] for e in trainer.backend.executors]


def _assert_same(got: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    assert len(got) == len(want) == 4  # 2 replicas x 2 stages
    for got_stage, want_stage in zip(got, want):
        for a, b in zip(got_stage, want_stage, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy", ["1f1b", "bfw"])
def test_zero_1_trains_as_zero_0_with_about_half_the_optimizer_state_per_replica(policy):
    with _trainer(zero=0, policy=policy) as plain:
        plain_reports = plain.fit(4)
        plain_weights = _weights(plain)
    with _trainer(zero=1, policy=policy) as sharded:
        sharded_reports = sharded.fit(4)
        sharded_weights = _weights(sharded)
    assert [r.loss for r in sharded_reports] == pytest.approx([r.loss for r in plain_reports], rel=1e-6)
    _assert_same(sharded_weights, plain_weights)
    full = {s.stage: s.optim_bytes for s in plain_reports[-1].stages if s.replica == 0}
    for stage, total in full.items():
        shards = [s.optim_bytes for s in sharded_reports[-1].stages if s.stage == stage]
        assert total > 0 and len(shards) == 2
        assert sum(shards) == total  # every parameter's state held once over the replicas
        assert max(shards) <= 0.65 * total  # about 1/D each (whole tensors: 3 weights over 2 replicas on stage 1)


def _captured_grads(*, zero: int) -> tuple[list[GradCapture], list[list[nn.Parameter]], list]:
    with _trainer(zero=zero) as trainer:
        captures = [GradCapture(e) for e in trainer.backend.executors]
        trainer.backend.executors = captures
        report = trainer.step()
        params = [e.runner.parameters() for e in captures]
    return captures, params, report.stages


def test_zero_1_reduces_each_gradient_to_its_owner_alone():
    summed, _, plain_stats = _captured_grads(zero=0)
    sharded, params, stats = _captured_grads(zero=1)
    for index, capture in enumerate(sharded):
        replica = index // 2
        owner = owners([p.numel() for p in params[index]], replicas=2)
        assert 0 < owner.count(replica) < len(owner)
        for got, want, o in zip(capture.grads, summed[index].grads, owner, strict=True):
            if o == replica:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
            else:  # its own replica's share only: not the sum
                assert not torch.allclose(got, want, rtol=1e-3, atol=1e-5)
    for stage in range(2):
        sent = [s.reduce_bytes for s in stats if s.stage == stage]
        received = [s.reduce_received_bytes for s in stats if s.stage == stage]
        assert sent[0] == sent[1] == next(s.reduce_bytes for s in plain_stats if s.stage == stage)
        assert sum(received) == sent[0]  # every sum went to one replica
        assert max(received) <= 0.65 * sent[0]  # about 1/D each
    assert all(s.reduce_received_bytes == s.reduce_bytes for s in plain_stats)  # zero 0: every replica gets every sum
    assert dp_summary([IterationReport(iteration=0, policy="bfw", makespan_ms=0.0, stages=stats)])[
        "dp_received_share"
    ] == pytest.approx(0.5)
    assert (
        dp_summary([IterationReport(iteration=0, policy="bfw", makespan_ms=0.0, stages=plain_stats)])[
            "dp_received_share"
        ]
        == 1.0
    )


def test_the_reducer_sends_owned_buckets_to_their_owner_and_unowned_ones_to_everyone():
    group = ThreadAllGather(parties=2, timeout_s=10)
    calls: list[str] = []

    def reducer(rank: int) -> GradReducer:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            calls.append(f"all {tensor.numel()}")
            return tensor_all_reduce(group.member(rank))(tensor)

        return GradReducer(
            all_reduce=all_reduce,
            reduce_to=tensor_reduce_to(group.member(rank), rank=rank),
            order=[0],
            bucket_bytes=1 << 20,
            timeout_s=10,
            name=f"r{rank}",
        )

    owner = [0, 1, None, 0]
    grads = [[torch.full((n,), 10.0 * r + i) for i, n in enumerate((3, 2, 4, 1))] for r in range(2)]
    stats = [None, None]

    def replica(r: int) -> None:
        reduce = reducer(r)
        reduce.begin()
        reduce.submit(key=0, grads=ChunkGradients(tensors=grads[r], owners=owner))
        stats[r] = reduce.wait()
        reduce.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    for r in range(2):
        for i, tensor in enumerate(grads[r]):
            want = 10.0 + 2 * i if owner[i] in (r, None) else 10.0 * r + i
            torch.testing.assert_close(tensor, torch.full_like(tensor, want))
    assert sorted(calls) == ["all 4", "all 4"]  # only the unowned bucket was all-reduced
    assert [s.nbytes for s in stats] == [40, 40]
    assert [s.received for s in stats] == [(3 + 1 + 4) * 4, (2 + 4) * 4]


def test_every_replicas_shard_is_checkpointed_and_resume_restores_them(tmp_path):
    with _trainer(zero=1) as clean:
        clean.fit(4)
        expected = _weights(clean)
    with _trainer(zero=1, directory=str(tmp_path)) as first:
        first.fit(2)
        first.save()
        manifest = first._latest()
    assert manifest is not None and sorted(manifest.files) == [0, 1, 2, 3]  # a file per replica's stage
    with _trainer(zero=1, directory=str(tmp_path), resume=True) as resumed:
        assert resumed.iteration == 2
        resumed.fit(2)
        _assert_same(_weights(resumed), expected)  # the moments of every replica's shard came back


@pytest.mark.parametrize(("saved", "resumed"), [(1, 0), (0, 1)])
def test_a_checkpoint_resumes_with_zero_switched_on_or_off(tmp_path, saved, resumed):
    """The replicas' optimizer shards merge onto a plain pipeline, and a plain checkpoint is cut into shards."""
    with _trainer(zero=saved) as clean:
        clean.fit(4)
        expected = _weights(clean)
    with _trainer(zero=saved, directory=str(tmp_path)) as first:
        first.fit(2)
        first.save()
    with _trainer(zero=resumed, directory=str(tmp_path), resume=True) as again:
        again.fit(2)
        _assert_same(_weights(again), expected)


def test_zero_1_without_data_parallelism_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match=r"zero 1 .* needs dp >= 2, got dp 1"):
        PipelineConfig(stages=2, microbatches=M, zero=1)


def test_owners_balance_the_elements_and_gather_sets_every_replica_to_the_owners_values():
    assert owners([1, 100, 1, 100], replicas=2) == [0, 0, 1, 1]
    group = ThreadAllGather(parties=2, timeout_s=10)
    owner = owners([3, 2, 4], replicas=2)
    params = [[torch.full((n,), 10.0 * r + i) for i, n in enumerate((3, 2, 4))] for r in range(2)]

    def gather(rank: int) -> None:
        gather_owned(
            params[rank], owner=owner, rank=rank, all_reduce=tensor_all_reduce(group.member(rank)), bucket_bytes=12
        )

    threads = [threading.Thread(target=gather, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    for r in range(2):
        for i, tensor in enumerate(params[r]):
            torch.testing.assert_close(tensor, torch.full_like(tensor, 10.0 * owner[i] + i))
