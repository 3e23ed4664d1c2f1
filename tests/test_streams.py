"""The CUDA hand-off between a stage's threads, observed on CPU through a fake `Handoff` that
treats every tensor as a GPU tensor: outputs reach the send thread with the event the compute
thread recorded for them, and received tensors reach compute with the receive thread's event."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
import torch

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.streams import Handoff
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.runtime.transport import local_channels
from rrfp_ray.runtime.worker import StageWorker
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate


@dataclass(frozen=True, eq=False)
class _Fence:
    kind: str  # produced | received
    thread: str
    pointer: int


class _Recording(Handoff):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str, _Fence | None, int | None]] = []  # (step, thread, fence, data pointer)
        self.lock = threading.Lock()

    def _note(self, step: str, fence: _Fence | None, pointer: int | None = None) -> None:
        with self.lock:
            self.log.append((step, threading.current_thread().name, fence, pointer))

    def produced(self, tensor):
        fence = _Fence("produced", threading.current_thread().name, tensor.data_ptr())
        self._note("produced", fence, tensor.data_ptr())
        return fence

    def before_send(self, fence):
        self._note("before_send", fence)

    def received(self, tensor):
        fence = _Fence("received", threading.current_thread().name, tensor.data_ptr())
        self._note("received", fence, tensor.data_ptr())
        return fence

    def before_use(self, tensor, fence):
        self._note("before_use", fence, tensor.data_ptr())


class _Watched:
    """A channel that logs (on the handoff's log) every payload it sends."""

    def __init__(self, inner, handoff: _Recording):
        self.inner, self.handoff = inner, handoff
        self.name, self.device = inner.name, inner.device

    def send(self, tensor):
        self.handoff._note("send", None, tensor.data_ptr())
        self.inner.send(tensor)

    def recv(self, tensor):
        self.inner.recv(tensor)


@pytest.mark.parametrize("policy_name", ["1f1b", "bf"])
def test_tensors_cross_threads_only_with_their_fences(policy_name):
    stages, microbatches = 2, 4
    policy = make_policy(name=policy_name, stages=stages, chunks=1, microbatches=microbatches)
    layout = Layout(stages=stages, chunks=1, microbatches=microbatches, split=policy.split)
    trace = generate(scenario="none", stages=stages, microbatches=microbatches, chunks=1, seed=0, t_f=0.5)
    workload = SyntheticWorkload(trace=trace, payload_elems=8)
    channels = local_channels(layout=layout, timeout_s=20)
    handoffs = [_Recording() for _ in range(stages)]
    workers = [
        StageWorker(
            stage=s,
            inbound={link: ch for link, ch in channels.items() if link.dst == s},
            outbound={link: _Watched(ch, handoffs[s]) for link, ch in channels.items() if link.src == s},
            timeout_s=20,
            handoff=handoffs[s],
        )
        for s in range(stages)
    ]
    compute_threads = [f"compute {s}" for s in range(stages)]
    errors = []

    def run(s: int) -> None:
        try:
            workers[s].run_iteration(
                args=IterationArgs(iteration=0, layout=layout, policy=policy, cap=Cap.parse("2x")),
                executor=workload.executor(stage=s, layout=layout),
            )
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(s,), name=compute_threads[s]) for s in range(stages)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    closes = [
        threading.Thread(target=worker.close) for worker in workers
    ]  # neighbours close together, as the backends do
    for thread in closes:
        thread.start()
    for thread in closes:
        thread.join(timeout=60)
    assert not errors

    for s, handoff in enumerate(handoffs):
        log = handoff.log
        sends = [entry for entry in log if entry[0] == "before_send" and entry[2] is not None]  # not STOP
        uses = [entry for entry in log if entry[0] == "before_use"]
        assert len(sends) == microbatches and len(uses) == microbatches  # one message out and one in per microbatch
        for _step, thread, fence, _ in sends:
            assert thread.startswith("send ") and fence.kind == "produced" and fence.thread == compute_threads[s]
        for _step, thread, fence, pointer in uses:
            assert thread == compute_threads[s] and fence.kind == "received" and fence.thread.startswith("recv ")
            assert pointer == fence.pointer  # the fence made for this very tensor
        # a send thread waits on a message's fence before any frame of that message goes out (a
        # message is one frame, or two when its size changed; the payload is copied into them)
        for thread in {entry[1] for entry in log if entry[1].startswith("send ")}:
            steps = [step for step, on, _, _ in log if on == thread and step in ("before_send", "send")]
            assert steps[0] == "before_send", f"stage {s}: {thread} sent a frame before waiting on any fence"
            assert steps.count("before_send") == microbatches + 1  # each message and the closing STOP


def test_cpu_tensors_need_no_fences():
    handoff = Handoff()
    tensor = torch.ones(3)
    assert handoff.produced(tensor) is None and handoff.received(tensor) is None
    with handoff.receiving("cpu"):
        handoff.before_send(None)
        handoff.before_use(tensor, None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_events_order_the_streams():
    handoff = Handoff()
    made = torch.randn(1 << 20, device="cuda") @ torch.ones(1 << 20, 1, device="cuda")  # work queued on compute
    fence = handoff.produced(made)
    result: dict[str, torch.Tensor] = {}

    def send() -> None:
        handoff.before_send(fence)
        result["sent"] = made.cpu()

    thread = threading.Thread(target=send, name="send 0")
    thread.start()
    thread.join(timeout=60)
    torch.testing.assert_close(result["sent"], made.cpu())

    def receive() -> None:
        with handoff.receiving("cuda"):
            buffer = torch.empty_like(made)
            buffer.copy_(made)  # stands in for the collective's fill, on the side stream
            result["fence"], result["buffer"] = handoff.received(buffer), buffer

    thread = threading.Thread(target=receive, name="recv 0")
    thread.start()
    thread.join(timeout=60)
    handoff.before_use(result["buffer"], result["fence"])
    torch.testing.assert_close(result["buffer"] * 1, made)
