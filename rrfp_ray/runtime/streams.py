"""Handing tensors between a stage's threads when they live on a GPU, and which thread uses which communicator.

One thread per communicator: every link's channel is used by one thread only (the send thread
for all outbound links, one receive thread per inbound link; each link is its own 2-rank group),
the TP group, the tie groups and the all-stages group (the executor's all-reduces, tied
gradients, the gradient norm) by the compute thread, a DP group by the stage's reduction thread. Two threads issuing ops on one
NCCL communicator can order them differently on the two ranks, which hangs both;
`actors/nccl_channel.py` enforces the rule where the ops are issued.

CUDA runs a thread's work asynchronously on that thread's current stream, so a tensor that
one thread has "made" may not be written yet when another thread reads it:
- an output made on the compute stream goes to the send thread with an event recorded after
  the op that made it; the send thread waits on that event before the collective library
  (which enqueues on its own stream) reads the tensor;
- a received tensor is allocated and filled on a receive side stream, with an event recorded
  after it is filled; the compute stream waits on that event before the op that uses it, and
  the tensor is marked as used on the compute stream (the caching allocator must not hand its
  memory to the side stream while compute still reads it).

For CPU tensors every step is a no-op (`Fence` None). `StageWorker` goes through `send`,
`receive` and `use`, which call the four hooks, so a fake `Handoff` observes them without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from rrfp_ray.runtime.transport import Channel, Header, recv_message, send_message

Fence = Any  # a torch.cuda.Event, or None where nothing needs waiting for


class Handoff:
    """CUDA events between the compute thread and the link threads (one instance per stage)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._side: dict[tuple[int, str], torch.cuda.Stream] = {}  # (device, receiving thread) -> its side stream

    def produced(self, tensor: torch.Tensor) -> Fence:
        """On the compute thread, right after the op that made `tensor`."""
        if not tensor.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def before_send(self, fence: Fence) -> None:
        """On the send thread, before the tensor goes out: a host wait, as the collective
        library's stream is not one of torch's."""
        if fence is not None:
            fence.synchronize()

    @contextlib.contextmanager
    def receiving(self, device: str) -> Iterator[None]:
        """On a receive thread, around allocating and filling a message's buffers: on this
        thread's side stream where `device` is a GPU."""
        target = torch.device(device)
        if target.type != "cuda":
            yield
            return
        with torch.cuda.stream(self._side_stream(target)):
            yield

    def received(self, tensor: torch.Tensor) -> Fence:
        """On the receive thread, once `tensor` is filled (inside `receiving`)."""
        if not tensor.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def before_use(self, tensor: torch.Tensor, fence: Fence) -> None:
        """On the compute thread, before the op that reads a received `tensor`."""
        if fence is None:
            return
        compute = torch.cuda.current_stream(tensor.device)
        compute.wait_event(fence)
        tensor.record_stream(compute)

    def send(self, *, channel: Channel, header: Header, payload: torch.Tensor | None, fence: Fence) -> None:
        """On the send thread: one message, once its payload is made."""
        self.before_send(fence)
        send_message(channel=channel, header=header, payload=payload)

    def receive(self, *, channel: Channel) -> tuple[Header, torch.Tensor | None, Fence]:
        """On a receive thread: the next message, filled on this thread's side stream, and its fence."""
        with self.receiving(channel.device):
            header, payload = recv_message(channel=channel)
            return header, payload, None if payload is None else self.received(payload)

    def use(self, tensor: torch.Tensor, fence: Fence) -> torch.Tensor:
        """On the compute thread: a received `tensor`, safe to read from the compute stream."""
        self.before_use(tensor, fence)
        return tensor

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        key = (device.index if device.index is not None else torch.cuda.current_device(), threading.current_thread().name)
        with self._lock:
            if key not in self._side:
                self._side[key] = torch.cuda.Stream(device=device)
            return self._side[key]
