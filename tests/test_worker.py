"""The runtime's stage loop in one process, over in-memory channels."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, tensor_all_reduce
from rrfp_ray.runtime.transport import Header, LocalChannel, MessageReader, MessageWriter
from rrfp_ray.runtime.worker import PipelineError
from rrfp_ray.schedule.actions import Kind, parse_action
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import IterationSettings, LocalBackend

P, M = 4, 8


def _run(*, name: str, chunks: int = 1, scenario: str = "lognormal", iterations: int = 2, pipeline=None):
    policy = make_policy(name=name, stages=P, chunks=chunks, microbatches=M)
    layout = Layout(stages=P, chunks=chunks, microbatches=M, split=policy.split)
    workload = SyntheticWorkload(
        trace=generate(scenario=scenario, stages=P, microbatches=M, chunks=chunks, seed=1, t_f=2.0), payload_elems=16
    )
    executors = [workload.executor(stage=s, layout=layout) for s in range(P)]
    own = pipeline is None
    pipeline = pipeline or LocalBackend.over(layout=layout, timeout_s=20)
    try:
        return (
            policy,
            layout,
            [
                pipeline.run_iteration(
                    iteration=i, policy=policy, cap=Cap.parse("2x"), executors=executors, latency=workload.latency
                )
                for i in range(iterations)
            ],
        )
    finally:
        if own:
            pipeline.close()


@pytest.mark.parametrize(
    ("name", "chunks"), [("1f1b", 1), ("interleaved", 2), ("bf", 1), ("bf", 2), ("bfw", 1), ("zb-h1", 1)]
)
def test_every_action_runs_exactly_once_per_iteration(name, chunks):
    _, layout, reports = _run(name=name, chunks=chunks)
    for report in reports:
        expected = sorted(str(a) for s in range(P) for a in layout.actions(stage=s))
        assert sorted(e.action for e in report.events) == expected


@pytest.mark.parametrize(("name", "chunks"), [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("gpipe", 1)])
def test_fixed_policy_runs_its_schedule_in_order(name, chunks):
    policy, _, reports = _run(name=name, chunks=chunks)
    for report in reports:
        for stage in range(P):
            ran = [e.action for e in sorted(report.events, key=lambda e: e.start_ms) if e.stage == stage]
            assert ran == [str(a) for a in policy.order[stage]]


@pytest.mark.parametrize("name", ["bf", "bfw", "ready-1f1b"])
def test_dependencies_hold_in_the_runtime(name):
    _, layout, reports = _run(name=name)
    for report in reports:
        ends = {e.action: e.end_ms for e in report.events}
        for event in report.events:
            action = parse_action(event.action, stages=layout.stages)
            local, message = layout.local_need(action), layout.message_need(action)
            if local is not None:
                assert event.start_ms >= ends[str(local)]
            if message is not None:
                sender = layout.action(
                    kind=Kind.F if message.kind is Kind.F else layout.backward,
                    virtual_stage=message.virtual_stage + (-1 if message.kind is Kind.F else 1),
                    microbatch=message.microbatch,
                )
                assert event.start_ms >= ends[str(sender)]
        for stage in range(P):
            spans = sorted((e.start_ms, e.end_ms) for e in report.events if e.stage == stage)
            assert all(a_end <= b_start + 1e-6 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_messages_carry_kind_microbatch_chunk_and_shape():
    channel = LocalChannel(name="test", timeout_s=1)
    layout = Layout(stages=2, chunks=2, microbatches=3)
    message = layout.sends(parse_action("1F2", stages=2))
    payload = torch.randn(2, 3, 5)
    MessageWriter(channel=channel).send(
        header=Header.for_payload(message=message, iteration=7, payload=payload), payload=payload
    )
    header, got = MessageReader(channel=channel).recv()
    assert (header.message, header.iteration, header.leaves[0].shape) == (message, 7, (2, 3, 5))
    assert layout.consumer(header.message) == parse_action("2F2", stages=2)
    torch.testing.assert_close(got, payload)


def test_a_message_carries_any_tree_of_tensors_with_its_dtypes_and_gradient_flags():
    channel = LocalChannel(name="test", timeout_s=1)
    message = Layout(stages=2, chunks=1, microbatches=1).sends(parse_action("0F0", stages=2))
    hidden = torch.randn(2, 3, dtype=torch.bfloat16).requires_grad_(True)
    payload = {
        "hidden": hidden,
        "mask": torch.tensor([[True, False, True]]),
        "extra": (torch.arange(4), [torch.zeros(1, 1, 1, 1, 1, 1, 1, 1, 1, 2)]),
    }
    MessageWriter(channel=channel).send(
        header=Header.for_payload(message=message, iteration=3, payload=payload), payload=payload
    )
    header, got = MessageReader(channel=channel).recv()
    assert header.iteration == 3 and set(got) == {"hidden", "mask", "extra"}
    assert got["hidden"].dtype == torch.bfloat16 and got["hidden"].requires_grad
    assert got["mask"].dtype == torch.bool and not got["mask"].requires_grad
    assert isinstance(got["extra"], tuple) and isinstance(got["extra"][1], list)
    assert torch.equal(got["mask"], payload["mask"]) and torch.equal(got["extra"][0], torch.arange(4))
    assert got["extra"][1][0].shape == (1,) * 9 + (2,)
    torch.testing.assert_close(got["hidden"].detach(), hidden.detach())


class _Counting(LocalChannel):
    def __init__(self) -> None:
        super().__init__(name="test", timeout_s=1)
        self.sizes: list[int] = []

    def send(self, tensor: torch.Tensor) -> None:
        self.sizes.append(tensor.numel())
        super().send(tensor)


def test_a_link_whose_payloads_keep_their_shape_sends_one_frame_per_message_and_any_shape_change_arrives():
    channel = _Counting()
    writer, reader = MessageWriter(channel=channel), MessageReader(channel=channel)
    layout = Layout(stages=2, chunks=1, microbatches=8)
    shapes = [(4, 3), (4, 3), (4, 3), (2, 5), (2, 5), (), (0, 3), (4, 3)]
    for m, shape in enumerate(shapes):
        message = layout.sends(parse_action(f"0F{m}", stages=2))
        payload = torch.randn(shape)
        writer.send(header=Header.for_payload(message=message, iteration=1, payload=payload), payload=payload)
        header, got = reader.recv()
        assert header.message == message and got.shape == shape
        torch.testing.assert_close(got, payload)
    # a new size: a header frame of the old size, then the body (none for an empty tensor)
    per_message = [2, 1, 1, 2, 1, 2, 1, 2]
    assert len(channel.sizes) == sum(per_message)
    writer.send(header=Header(message=None), payload=None)
    assert reader.recv() == (Header(message=None), None)


class _Losing:
    """An inbound channel that loses every message after its first `keep` tensors: a later recv
    waits well past the pipeline's timeout, then gives up."""

    def __init__(self, inner: LocalChannel, *, keep: int) -> None:
        self.inner, self.keep = inner, keep

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def recv(self, tensor: torch.Tensor) -> None:
        if self.keep > 0:
            self.keep -= 1
            return self.inner.recv(tensor)
        threading.Event().wait(5 * self.inner.timeout_s)
        raise TimeoutError(f"channel {self.name}: nothing received")


def test_a_message_that_never_arrives_raises_naming_link_and_action():
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=2)
    layout = Layout(stages=2, chunks=1, microbatches=2)
    link = next(link for link in layout.links() if link.kind is Kind.F)

    def wrap(rank: int, channel: LocalChannel):  # header + payload of microbatch 0 only
        return _Losing(channel, keep=2) if channel.name == str(link) else channel

    pipeline = LocalBackend.over(layout=layout, timeout_s=1.0, wrap=wrap)
    workload = SyntheticWorkload(trace=generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0))
    executors = [workload.executor(stage=s, layout=layout) for s in range(2)]
    with pytest.raises(PipelineError, match=r"1F1 \(needs activations 0->1 for microbatch 1\)"):
        pipeline.run_iteration(iteration=0, policy=policy, cap=Cap.parse("inf"), executors=executors)


def test_tp_ranks_replay_one_trace_with_their_own_message_latencies():
    def trace(seed: int, stages: int = 2):
        return generate(scenario="lognormal+comm", stages=stages, microbatches=4, chunks=1, seed=seed, t_f=2.0)

    shared = SyntheticWorkload(trace=trace(0))
    assert shared.with_tp(rank=1, size=2, all_reduce=torch.clone).trace == shared.trace
    workload = SyntheticWorkload(trace=trace(0), rank_comm=(trace(0), trace(1)))
    rank0, rank1 = (workload.with_tp(rank=t, size=2, all_reduce=torch.clone).trace for t in range(2))
    assert rank0 == trace(0)
    assert (rank1.F, rank1.B, rank1.W) == (rank0.F, rank0.B, rank0.W)
    assert (rank1.commF, rank1.commB) == (trace(1).commF, trace(1).commB) != (rank0.commF, rank0.commB)
    with pytest.raises(ValueError, match="rank_comm holds 2 traces, the TP group has 4 ranks"):
        workload.with_tp(rank=0, size=4, all_reduce=torch.clone)
    with pytest.raises(ValueError, match=r"rank_comm\[1\] is shaped"):
        SyntheticWorkload(trace=trace(0), rank_comm=(trace(0), trace(1, stages=3))).with_tp(
            rank=1, size=2, all_reduce=torch.clone
        )


def _timed_tp_run(
    *, action: str, ranks: int, late_s: float, running: tuple[int, ...] | None = None
) -> dict[int, float]:
    """Seconds each running TP rank's `action` (20 ms in the trace) took; rank r starts it r * late_s late."""
    layout = Layout(stages=2, chunks=1, microbatches=1, split=True)
    workload = SyntheticWorkload(trace=generate(scenario="none", stages=2, microbatches=1, chunks=1, seed=0, t_f=20.0))
    gather = ThreadAllGather(parties=ranks, timeout_s=5.0)
    took: dict[int, float] = {}

    def run(rank: int) -> None:
        time.sleep(late_s * rank)
        tp = workload.with_tp(rank=rank, size=ranks, all_reduce=tensor_all_reduce(gather.member(rank)))
        began = time.perf_counter()
        tp.executor(stage=0, layout=layout).run(action=parse_action(action, stages=2), iteration=0, payload=None)
        took[rank] = time.perf_counter() - began

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (running or range(ranks))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5.0)
    return took


@pytest.mark.parametrize("action", ["0F0", "0I0"])
def test_synthetic_tp_forward_and_backward_end_after_the_later_rank_started(action: str):
    """As the TP collectives inside real F and B ops make them: rank 0 waits for rank 1, then runs."""
    took = _timed_tp_run(action=action, ranks=2, late_s=0.2)
    assert took[0] >= 0.2 + 0.02 - 0.005


def test_a_synthetic_weight_pass_calls_no_tp_collective():
    took = _timed_tp_run(action="0W0", ranks=2, late_s=0.0, running=(0,))
    assert took[0] < 0.2  # rank 1 never runs it: a collective would have held rank 0 for the 5 s barrier timeout


class _SlowStep:
    """An executor whose optimizer step (`finish`) takes `step_s` on one stage."""

    def __init__(self, inner, *, step_s: float) -> None:
        self.inner, self.step_s = inner, step_s

    def begin(self, *, args: IterationArgs) -> None:
        self.inner.begin(args=args)

    def run(self, **kwargs):
        return self.inner.run(**kwargs)

    def finish(self, *, iteration: int, all_reduce):
        time.sleep(self.step_s)
        return self.inner.finish(iteration=iteration, all_reduce=all_reduce)


def test_the_iteration_time_covers_the_optimizer_step():
    policy = make_policy(name="1f1b", stages=2, chunks=1, microbatches=2)
    layout = Layout(stages=2, chunks=1, microbatches=2, split=False)
    trace = generate(scenario="none", stages=2, microbatches=2, chunks=1, seed=0, t_f=1.0)
    workload = SyntheticWorkload(trace=trace, payload_elems=4)
    executors = [workload.executor(stage=s, layout=layout) for s in range(2)]
    executors[1] = _SlowStep(executors[1], step_s=0.3)
    with LocalBackend.over(layout=layout, timeout_s=20) as pipeline:
        report = pipeline.run_iteration(iteration=0, policy=policy, cap=Cap.parse("inf"), executors=executors)
    slow = report.stages[1]
    assert slow.step_ms >= 300 and slow.wall_ms >= slow.compute_ms + slow.step_ms
    assert report.makespan_ms >= max(e.end_ms for e in report.events if e.stage == 1) + 300
    assert report.schedule_ms >= max(e.end_ms for e in report.events)  # the ops alone, without the step
    assert report.schedule_ms == pytest.approx(report.makespan_ms - report.step_ms)
    assert slow.blocked_ms < slow.wall_ms - slow.step_ms + 1e-9  # the step is not counted as blocked


def _slow_middle_stage(*, microbatches: int) -> tuple:
    """P=3: stage 1's ops take 10x the others', so activations and gradients reach it together."""
    trace = generate(scenario="none", stages=3, microbatches=microbatches, chunks=1, seed=0, t_f=1.0)
    slow = {
        key: tuple(tuple(x * (10 if s == 1 else 1) for x in row) for s, row in enumerate(getattr(trace, key)))
        for key in "FBW"
    }
    return replace(trace, **slow), Layout(stages=3, chunks=1, microbatches=microbatches)


@pytest.mark.parametrize("limit", [1, 2])
def test_the_receive_buffer_never_holds_more_than_its_limit_with_several_inbound_links(limit):
    trace, layout = _slow_middle_stage(microbatches=6)
    policy = make_policy(name="bf", stages=3, chunks=1, microbatches=6)
    executors = [SyntheticWorkload(trace=trace, payload_elems=16).executor(stage=s, layout=layout) for s in range(3)]
    settings = IterationSettings(buffer_limit=limit)
    with LocalBackend.over(layout=layout, timeout_s=20, settings=settings) as pipeline:
        report = pipeline.run_iteration(iteration=0, policy=policy, cap=Cap.parse("inf"), executors=executors)
    assert sorted(e.action for e in report.events) == sorted(str(a) for s in range(3) for a in layout.actions(stage=s))
    assert report.stages[1].peak_buffered == limit  # reached, never passed, although two links feed it
