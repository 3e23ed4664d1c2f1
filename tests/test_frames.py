"""Host and device frames (`rrfp_ray.runtime.frames`): the same bytes either way, every dtype
and layout that can cross a stage boundary, and host frames built and read without a torch op."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rrfp_ray.runtime.frames import DeviceFrames, HostFrames
from rrfp_ray.runtime.transport import DTYPES, Header, LocalChannel, MessageReader, MessageWriter
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Message

KINDS = {"host": HostFrames(), "device": DeviceFrames(device="cpu")}


def _payloads() -> list:
    made = [torch.arange(24, dtype=torch.float64).view(4, 6).t()]  # not contiguous
    made += [(torch.rand(3, 5) * 9).to(dtype) for dtype in DTYPES]
    made += [torch.randn(()), torch.empty(0, 7), torch.randn(2, 3, requires_grad=True)]
    made += [{"h": torch.randn(2, 1, 1, 1, 1, 1, 1, 1, 1, 2), "mask": torch.tensor([True, False])}]
    return made


def _send_all(writer: MessageWriter, payloads: list) -> None:
    for mb, payload in enumerate(payloads):
        message = Message(kind=Kind.F, virtual_stage=1, microbatch=mb)
        writer.send(header=Header.for_payload(message=message, iteration=2, payload=payload), payload=payload)


def _same(got, sent) -> None:
    if isinstance(sent, dict):
        assert got.keys() == sent.keys()
        for key in sent:
            _same(got[key], sent[key])
        return
    assert (got.dtype, got.shape, got.requires_grad) == (sent.dtype, sent.shape, sent.requires_grad)
    assert torch.equal(got.detach(), sent.detach())


@pytest.mark.parametrize(("written", "read"), [("host", "host"), ("host", "device"), ("device", "host")])
def test_frames_read_back_whichever_way_they_were_built(written: str, read: str) -> None:
    channel = LocalChannel(name="frames", timeout_s=5)
    payloads = _payloads()
    _send_all(MessageWriter(channel=channel, frames=KINDS[written]), payloads)
    reader = MessageReader(channel=channel, frames=KINDS[read])
    for mb, payload in enumerate(payloads):
        header, got = reader.recv()
        assert (header.message.microbatch, header.iteration) == (mb, 2)
        _same(got, payload)


# What torch.from_numpy and Tensor.numpy run inside: their Python bindings keep the GIL, unlike the
# bindings of the ops themselves (torch.empty, Tensor.view, slicing, copies), which give it up.
_FROM_NUMPY_AND_BACK = {"aten.lift_fresh.default", "aten.detach.default"}


class _AtenOps(TorchDispatchMode):
    """Records the ATen ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["host", "device"])
def test_host_frames_are_built_and_read_without_an_op_that_gives_up_the_gil(kind: str) -> None:
    channel = LocalChannel(name="frames", timeout_s=5)
    writer, reader = (
        MessageWriter(channel=channel, frames=KINDS[kind]),
        MessageReader(channel=channel, frames=KINDS[kind]),
    )
    payload = torch.randn(64, 64)
    _send_all(writer, [payload])  # the link's first message: header and body apart; then one frame each
    reader.recv()
    with _AtenOps() as counted:
        _send_all(writer, [payload, payload])
        got = [reader.recv()[1] for _ in range(2)]
    assert all(torch.equal(g, payload) for g in got)
    others = [op for op in counted.ops if op not in _FROM_NUMPY_AND_BACK]
    if kind == "host":
        assert others == []
    else:  # the torch-op path, for contrast: the check above could fail
        assert len(others) > 10
