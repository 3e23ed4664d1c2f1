"""Handing tensors between a stage's threads when they live on a GPU, and which thread uses which communicator.

One thread per communicator: every link's channel is used by one thread only (one send thread
per outbound link, one receive thread per inbound link, or the compute thread for a TCP link it
polls, `rrfp_ray.runtime.polled`; each link is its own 2-rank group),
the TP group, the tie groups and the all-stages group (the executor's all-reduces, tied
gradients, the gradient norm) by the compute thread, a DP group by the stage's reduction thread. Two threads issuing ops
on one NCCL communicator can order them differently on the two ranks, which hangs both;
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

A message's payload is a tree of tensors (`runtime.tree`); one event covers all its leaves.
For CPU tensors every step is a no-op (`Fence` None). `StageWorker` goes through `send`,
`receive` and `use`, which call the four hooks, so a fake `Handoff` observes them without a GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from rrfp_ray.runtime.transport import Header, MessageReader, MessageWriter
from rrfp_ray.runtime.tree import Tree, flatten

Fence = Any  # a torch.cuda.Event, or None where nothing needs waiting for


class Handoff:
    """CUDA events between the compute thread and the link threads (one instance per stage)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._side: dict[tuple[int, str], torch.cuda.Stream] = {}  # (device, receiving thread) -> its side stream

    def produced(self, tree: Tree) -> Fence:
        """On the compute thread, right after the op that made `tree`."""
        return _record(tree)

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

    def received(self, tree: Tree) -> Fence:
        """On the receive thread, once `tree` is filled (inside `receiving`)."""
        return _record(tree)

    def before_use(self, tree: Tree, fence: Fence) -> None:
        """On the compute thread, before the op that reads a received `tree`."""
        if fence is None:
            return
        leaves = [t for t in flatten(tree)[0] if t.is_cuda]
        compute = torch.cuda.current_stream(leaves[0].device)
        compute.wait_event(fence)
        for leaf in leaves:
            leaf.record_stream(compute)

    def send(self, *, writer: MessageWriter, header: Header, payload: Tree | None, fence: Fence) -> None:
        """On the send thread: one message, once its payload is made."""
        self.before_send(fence)
        writer.send(header=header, payload=payload)

    def receive(self, *, reader: MessageReader) -> tuple[Header, Tree | None, Fence]:
        """On a receive thread: the next message, filled on this thread's side stream, and its fence."""
        if reader.on_host:  # no stream to enter
            header, payload = reader.recv()
            return header, payload, None if payload is None else self.received(payload)
        with self.receiving(reader.channel.device):
            header, payload = reader.recv()
            return header, payload, None if payload is None else self.received(payload)

    def use(self, tree: Tree, fence: Fence) -> Tree:
        """On the compute thread: a received `tree`, safe to read from the compute stream."""
        self.before_use(tree, fence)
        return tree

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        key = (
            device.index if device.index is not None else torch.cuda.current_device(),
            threading.current_thread().name,
        )
        with self._lock:
            if key not in self._side:
                self._side[key] = torch.cuda.Stream(device=device)
            return self._side[key]


def _record(tree: Tree) -> Fence:
    """An event on the current stream of `tree`'s GPU, or None for CPU tensors."""
    if isinstance(tree, torch.Tensor) and not tree.is_cuda:
        return None
    cuda = [t for t in flatten(tree)[0] if t.is_cuda]
    if not cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(cuda[0].device))
    return event
