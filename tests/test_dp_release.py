"""Data parallelism's reduction takes a chunk in parts: a bucket is summed as soon as its gradients
are final, while the chunk's last weight-gradient op still runs, and the sums are the very bits
the whole chunk handed over at once gives."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from examples.mlp import Regression, mlp
from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.runtime.reduce import ChunkGradients, GradReducer
from rrfp_ray.runtime.synthetic import SleepExecutor
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, tensor_all_reduce, tensor_reduce_to
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.grad_ready import Bucketer
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.release import GradRelease

SIZES = (3, 5, 2, 6, 4)  # float32 elements of each gradient of one chunk
OWNERS = [0, 1, None, 0, 1]  # ZeRO-1's, for the runs with owners


def _replicas(*, parts: list[list[int]], owners: list[int | None] | None, between=None):
    """Two replicas reduce one chunk of SIZES handed over in `parts` (index runs), 8-element
    buckets; `between(rank, seen)` runs after each part but the last, before the chunk is complete.
    Returns each replica's gradients after the reduction and the sizes every all-reduce summed."""
    group = ThreadAllGather(parties=2, timeout_s=10)
    seen: list[list[int]] = [[], []]
    grads = [
        [torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i)) for i, n in enumerate(SIZES)]
        for r in range(2)
    ]

    def reducer(rank: int) -> GradReducer:
        def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
            seen[rank].append(tensor.numel())
            return tensor_all_reduce(group.member(rank))(tensor)

        def reduce_to(tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
            seen[rank].append(tensor.numel())
            return tensor_reduce_to(group.member(rank), rank=rank)(tensor, dst)

        return GradReducer(
            all_reduce=all_reduce, reduce_to=reduce_to, order=[0], bucket_bytes=8 * 4, timeout_s=10, name=f"r{rank}"
        )

    def replica(rank: int) -> None:
        reduce = reducer(rank)
        reduce.begin()
        for index, run in enumerate(parts):
            tensors = [grads[rank][i] for i in run]
            reduce.add(
                key=0, part=ChunkGradients(tensors=tensors, owners=None if owners is None else [owners[i] for i in run])
            )
            if between is not None and index < len(parts) - 1:
                between(rank, seen[rank])
        reduce.complete(key=0)
        reduce.wait()
        reduce.close()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return grads, seen


@pytest.mark.parametrize("owners", [None, OWNERS], ids=["all-reduce", "zero-1"])
def test_in_parts_the_reduction_gives_the_bits_of_the_whole_chunk_in_the_same_buckets(owners):
    whole, whole_buckets = _replicas(parts=[[0, 1, 2, 3, 4]], owners=owners)
    split, split_buckets = _replicas(parts=[[0], [1, 2], [3], [4]], owners=owners)
    for rank in range(2):
        for got, want in zip(split[rank], whole[rank], strict=True):
            assert torch.equal(got, want)
    assert split_buckets == whole_buckets  # the buckets depend on the gradients, not on the parts
    if owners is None:
        assert whole_buckets[0] == [8, 8, 4]  # 3+5, 2+6 (full), 4


def test_a_bucket_is_summed_once_its_gradients_are_in_before_the_chunk_is_complete():
    def until_a_bucket_went(rank: int, seen: list[int]) -> None:
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [8], f"replica {rank}: no bucket summed before the chunk was complete"

    # 3 + 5 elements fill the first 8-element bucket: it goes while the rest is still to come
    _, seen = _replicas(parts=[[0, 1], [2, 3, 4]], owners=None, between=until_a_bucket_went)
    assert seen == [[8, 8, 4], [8, 8, 4]]


def test_the_bucketer_closes_a_bucket_when_full_or_when_the_next_item_of_its_group_does_not_fit():
    bucketer: Bucketer[str] = Bucketer(bucket_bytes=10)
    assert bucketer.add("a", nbytes=4, group=0) == []
    assert bucketer.add("b", nbytes=4, group=1) == []
    assert bucketer.add("c", nbytes=6, group=0) == [["a", "c"]]  # full
    assert bucketer.add("d", nbytes=7, group=1) == [["b"]]  # 4 + 7 > 10
    assert bucketer.add("e", nbytes=1, group=1, kind="f64") == [["d"]]  # another dtype
    assert bucketer.add("f", nbytes=30, group=0) == [["f"]]  # a big one alone
    assert bucketer.flush() == [["e"]]


def test_the_synthetic_last_weight_op_finalizes_its_layers_through_its_duration_last_layer_first():
    trace = generate(scenario="none", stages=1, microbatches=1, chunks=1, seed=0, t_f=80.0)  # W: 80 ms
    layout = Layout(stages=1, chunks=1, microbatches=1, split=True)
    executor = SleepExecutor(trace=trace, layout=layout, payload_elems=1, grad_elems=10, grad_layers=4)
    released: list[tuple[float, ChunkGradients]] = []
    began = time.perf_counter()
    executor.run(
        action=Action(virtual_stage=0, kind=Kind.W, microbatch=0, stage=0, chunk=0),
        iteration=0,
        payload=None,
        release=lambda part: released.append((time.perf_counter(), part)),
    )
    ended = time.perf_counter()
    assert len(released) == 4
    assert released[0][0] - began < (ended - began) * 0.5  # the first layer went a quarter through the op
    parts = [t for _, part in released for t in part.tensors]
    assert [t.numel() for t in parts] == [2, 2, 3, 3]  # 10 elements in 4 layers (3, 3, 2, 2), the last first
    assert all(a is b for a, b in zip(parts, executor.gradients(chunk=0).tensors, strict=True))


def test_grad_release_hands_over_the_final_head_of_its_order_as_it_grows():
    layers = [nn.Linear(2, 2, bias=False) for _ in range(3)]
    order = [layer.weight for layer in layers]
    released: list[list[int]] = []
    index = {id(p): i for i, p in enumerate(order)}
    with GradRelease(params=order, release=lambda params: released.append([index[id(p)] for p in params])):
        for i in (2, 0, 1):  # finalized out of order
            layers[i](torch.ones(1, 2)).sum().backward()
            released.append(["after", i])
    assert released == [["after", 2], [0], ["after", 0], [1, 2], ["after", 1]]


class _Parts:
    """Wraps an executor; records the parts each release got and the chunk's gradients right after the op."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.runs: list[tuple[list[list[torch.Tensor]], list[torch.Tensor]]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def run(self, *, action, release=None, **kwargs):
        if release is None:
            return self.inner.run(action=action, **kwargs)
        parts: list[list[torch.Tensor]] = []

        def record(part: ChunkGradients) -> None:
            parts.append(list(part.tensors))
            release(part)

        out = self.inner.run(action=action, release=record, **kwargs)
        self.runs.append((parts, list(self.inner.gradients(chunk=action.chunk).tensors)))
        return out


def _trainer(*, overlap: bool, policy: str) -> Trainer:
    config = PipelineConfig(
        stages=2, microbatches=2, policy=policy, dp=2, dp_overlap=overlap, dp_bucket_mb=1e-4, timeout_s=30
    )
    return Trainer(
        model=mlp,
        loss_fn=nn.functional.mse_loss,
        data=Regression(microbatches=4),
        pipeline=config,
        optimizer=Optim(lr=1e-2, warmup=0, total=10),
    )


@pytest.mark.parametrize("policy", ["1f1b", "bfw"])
def test_the_model_releases_a_chunks_gradients_in_parts_and_trains_to_the_bits_of_the_unsplit_reduction(policy):
    with _trainer(overlap=True, policy=policy) as split:
        recorders = [_Parts(e) for e in split.backend.executors]
        split.backend.executors = recorders
        split_losses = [r.loss for r in split.fit(3)]
        split_weights = [[p.detach().clone() for p in e.runner.parameters()] for e in recorders]
    with _trainer(overlap=False, policy=policy) as whole:  # each chunk handed over whole, after every op
        whole_losses = [r.loss for r in whole.fit(3)]
        whole_weights = [[p.detach().clone() for p in e.runner.parameters()] for e in whole.backend.executors]
    assert split_losses == whole_losses
    for got_stage, want_stage in zip(split_weights, whole_weights, strict=True):
        for got, want in zip(got_stage, want_stage, strict=True):
            assert torch.equal(got, want)
    for recorder in recorders:
        assert len(recorder.runs) == 3  # one last weight-gradient op an iteration (one chunk)
        for parts, grads in recorder.runs:
            assert len(parts) > 1  # released during the op, not all at its end
            assert [id(t) for part in parts for t in part] == [
                id(t) for t in grads
            ]  # they make up the chunk's, in order
