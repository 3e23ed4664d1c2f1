"""Message framing and the channel interface; an in-memory channel for one-process runs.

A message is one frame, a uint8 tensor: a fixed-size int64 header, then (unless it is STOP)
its body: a description (JSON: the tree's structure, and each leaf's dtype, shape and whether
it carries a gradient back; empty for a lone tensor, whose dtype and shape fit in the header)
and the bytes of every leaf of its payload, a tree of tensors (`rrfp_ray.runtime.tree`), each
section 8-byte aligned. Collectives need the receiver to post a buffer of the sender's size, so
both ends of a channel track the size of its last message (`MessageWriter`, `MessageReader`):
a message of that size travels as one frame (the steady state: a link's payloads keep their
shape), any other as a header frame of the old size followed by its body, whose size is the
new one. The same framing runs over every channel (in memory, TCP, gloo, NCCL). A `Channel` is
one direction of one link; the TCP one lives in `rrfp_ray.runtime.tcp_channel`, the collective
ones in `actors/collective.py`, the in-memory one here. Frames in host memory are built without
torch ops, frames on a GPU with them (`rrfp_ray.runtime.frames`).
"""

from __future__ import annotations

import enum
import functools
import json
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rrfp_ray.runtime.frames import HEADER_BYTES, HEADER_LEN, Buffer, Frames, HostFrames, frames_for
from rrfp_ray.runtime.tree import LEAF, Structure, Tree, flatten, unflatten
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Layout, Link, Message

_FIXED = 11  # code, virtual stage, microbatch, iteration, description bytes, body bytes, sent at, released at, dtype,
# ndim, requires grad
MAX_DIMS = HEADER_LEN - _FIXED  # a lone tensor with more dims travels with a description
_ALIGN = 8
_F_CODE, _B_CODE = 1, 2
_KIND_CODE = {Kind.F: _F_CODE, Kind.B: _B_CODE}
_STOP = 0
DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.int8,
    torch.int16,
)

_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}


class LinkTransport(enum.Enum):
    """What carries the links: `auto` is NCCL where CUDA and cupy are present, else TCP
    (`actors/collective.py` resolves it). With TCP (`rrfp_ray.runtime.tcp_channel`) the other
    groups (all stages, TP, DP, tied parameters) are gloo's."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"
    TCP = "tcp"


class Channel(Protocol):
    name: str
    device: str  # where the tensors it sends and receives live ("cpu" for gloo, "cuda" for NCCL)

    def send(self, tensor: torch.Tensor) -> None: ...

    def recv(self, tensor: torch.Tensor) -> None:
        """Fill `tensor` in place; raise TimeoutError naming the channel if nothing comes in time."""
        ...


class NonBlockingChannel(Channel, Protocol):
    """A channel whose sender may also write without waiting (`rrfp_ray.runtime.links` lets the compute
    thread write a message itself when its link is idle)."""

    def try_send(self, tensor: torch.Tensor) -> int:
        """Write what fits at once of `tensor`'s bytes, waiting for nothing; how many bytes went."""
        ...


@dataclass(frozen=True)
class Leaf:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool = False  # the receiver treats it as differentiable and sends its gradient back

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Leaf:
        if tensor.dtype not in _DTYPE_CODE:
            raise ValueError(f"a {tensor.dtype} tensor cannot cross a stage boundary; dtypes: {DTYPES}")
        return cls(dtype=tensor.dtype, shape=tuple(tensor.shape), requires_grad=tensor.requires_grad)


@dataclass(frozen=True)
class Header:
    message: Message | None  # None: STOP
    iteration: int = 0
    structure: Structure = LEAF
    leaves: tuple[Leaf, ...] = (Leaf(dtype=torch.float32, shape=()),)
    sent_at: float = 0.0  # when its frame left, in wall-clock seconds (set on receipt; 0: not sent)
    released_at: float = 0.0  # wall-clock seconds: its sender's hand-off plus the latency injected on its link

    def description(self) -> bytes:
        """Empty for a lone tensor that fits in the header; else the JSON that follows it."""
        if self.structure == LEAF and len(self.leaves[0].shape) <= MAX_DIMS:
            return b""
        leaves = [[DTYPES.index(leaf.dtype), int(leaf.requires_grad), list(leaf.shape)] for leaf in self.leaves]
        return json.dumps({"tree": self.structure, "leaves": leaves}, separators=(",", ":")).encode()

    def fields(self, *, described: bytes, body_bytes: int) -> list[int]:
        """The header's int64 fields, stamped with the time they are made."""
        m = self.message
        if m is None:
            return [_STOP] + [0] * (HEADER_LEN - 1)
        leaf = self.leaves[0] if not described else _DESCRIBED
        shape = leaf.shape
        return [
            _F_CODE if m.kind is Kind.F else _B_CODE,  # a message is an F's output or a backward's
            m.virtual_stage,
            m.microbatch,
            self.iteration,
            len(described),
            body_bytes,
            round(time.time() * 1e6),
            round(self.released_at * 1e6),
            _DTYPE_CODE[leaf.dtype],
            len(shape),
            int(leaf.requires_grad),
            *shape,
            *_ZEROS[len(shape) :],
        ]

    @classmethod
    def decode(cls, fields: Sequence[int], *, description: bytes = b"") -> Header:
        code, vs, mb, iteration, _, _, sent_us, released_us, dtype, ndim, grad, *shape = fields
        if code == _STOP:
            return _STOP_HEADER
        message = _message(code, vs, mb)
        if not description:
            leaf = _leaf(dtype, tuple(shape[:ndim]), grad)
            return cls(
                message=message,
                iteration=iteration,
                leaves=(leaf,),
                sent_at=sent_us / 1e6,
                released_at=released_us / 1e6,
            )
        spec = json.loads(description)
        leaves = tuple(Leaf(dtype=DTYPES[d], shape=tuple(s), requires_grad=bool(g)) for d, g, s in spec["leaves"])
        return cls(
            message=message,
            iteration=iteration,
            structure=spec["tree"],
            leaves=leaves,
            sent_at=sent_us / 1e6,
            released_at=released_us / 1e6,
        )

    @classmethod
    def for_payload(cls, *, message: Message, iteration: int, payload: Tree, released_at: float = 0.0) -> Header:
        if isinstance(payload, torch.Tensor):  # a lone tensor: the common case, without walking a tree
            return cls(message=message, iteration=iteration, leaves=(Leaf.of(payload),), released_at=released_at)
        tensors, structure = flatten(payload)
        leaves = tuple(Leaf.of(t) for t in tensors)
        return cls(message=message, iteration=iteration, structure=structure, leaves=leaves, released_at=released_at)

    @property
    def is_stop(self) -> bool:
        return self.message is None


@functools.lru_cache(maxsize=4096)
def _message(code: int, virtual_stage: int, microbatch: int) -> Message:
    """A header's message, made once (a link brings the same few again each iteration)."""
    return Message(kind=_CODE_KIND[code], virtual_stage=virtual_stage, microbatch=microbatch)


@functools.lru_cache(maxsize=256)
def _leaf(dtype: int, shape: tuple[int, ...], grad: int) -> Leaf:
    """A header's lone leaf, made once per dtype code, shape and gradient flag."""
    return Leaf(dtype=DTYPES[dtype], shape=shape, requires_grad=bool(grad))


_STOP_HEADER = Header(message=None)
_DESCRIBED = Leaf(dtype=torch.float32, shape=())  # the header's leaf fields of a described message
_ZEROS = (0,) * MAX_DIMS
_CODE_KIND = {code: kind for kind, code in _KIND_CODE.items()}


class MessageWriter:
    """The sending end of a channel's framing; one thread uses it. `frames`: how frames are built
    (by default as the channel's device needs).

    Over a channel that has taken a frame's bytes once its send returns (`copies_on_send`: TCP, whose
    kernel holds a copy), a host frame of the link's steady size is built in one buffer, reused
    message after message; a caller that leaves part of a frame to send later (`rrfp_ray.runtime.links`)
    sends it before it asks for the next message's frames."""

    def __init__(self, *, channel: Channel, frames: Frames | None = None) -> None:
        self.channel = channel
        self._frames = frames or frames_for(channel.device)
        self._frame_bytes = HEADER_BYTES  # what the receiver posts for the next message
        self._out = _carrier(channel, self._frames)
        self._reuse = getattr(channel, "copies_on_send", False) and isinstance(self._frames, HostFrames)
        self._frame: Buffer | None = None  # the reused frame (`_reuse`), of `_frame_bytes`

    def send(self, *, header: Header, payload: Tree | None) -> None:
        for frame in self.frames(header=header, payload=payload):
            self.channel.send(frame)

    def frames(self, *, header: Header, payload: Tree | None) -> list[torch.Tensor | Buffer]:
        """The frames of one message, to go out in order on this writer's channel (the caller sends them)."""
        frames = self._frames
        if isinstance(payload, torch.Tensor) and header.structure == LEAF and payload.dim() <= MAX_DIMS:
            described, tensors = b"", (payload,)  # a lone tensor, described by the header alone
            sections = (0, -(-payload.nbytes // _ALIGN) * _ALIGN)
            body_bytes = sections[1]
        else:
            described = b"" if header.is_stop else header.description()
            tensors = [] if payload is None else [payload] if isinstance(payload, torch.Tensor) else flatten(payload)[0]
            sections = [_aligned(len(described))] + [_aligned(t.numel() * t.element_size()) for t in tensors]
            body_bytes = sum(sections)
        inline = HEADER_BYTES + body_bytes == self._frame_bytes
        frame = self._frame if inline and self._frame is not None else frames.empty(self._frame_bytes)
        frames.put_header(frame, header.fields(described=described, body_bytes=body_bytes))
        body = frames.tail(frame, HEADER_BYTES) if inline else frames.empty(body_bytes)
        if described:
            frames.put_bytes(body, 0, described)
        offset = sections[0]
        for tensor, size in zip(tensors, sections[1:]):
            frames.put_tensor(body, offset, tensor)
            offset += size
        out = self._out
        if inline or header.message is None:
            if inline and self._reuse:
                self._frame = frame
            return [out(frame)]
        self._frame_bytes = HEADER_BYTES + body_bytes
        self._frame = None
        return [out(frame), out(body)] if body_bytes else [out(frame)]


class MessageReader:
    """The receiving end of a channel's framing; one thread uses it. `frames`: as the writer's."""

    def __init__(self, *, channel: Channel, frames: Frames | None = None) -> None:
        self.channel = channel
        self._frames = frames or frames_for(channel.device)
        self._frame_bytes = HEADER_BYTES
        self._out = _carrier(channel, self._frames)
        self.on_host = torch.device(channel.device).type == "cpu"  # no stream to receive on

    def recv(self) -> tuple[Header, Tree | None]:
        frames = self._frames
        frame = frames.empty(self._frame_bytes)
        self.channel.recv(self._out(frame))
        fields = frames.header(frame)
        if fields[0] == _STOP:
            return _STOP_HEADER, None
        described_bytes, body_bytes = fields[4], fields[5]
        if HEADER_BYTES + body_bytes == self._frame_bytes:
            body = frames.tail(frame, HEADER_BYTES)
        else:
            body = frames.empty(body_bytes)
            if body_bytes:
                self.channel.recv(self._out(body))
            self._frame_bytes = HEADER_BYTES + body_bytes
        if not described_bytes:  # a lone tensor, described by the header alone
            header = Header.decode(fields)
            leaf = header.leaves[0]
            tensor = frames.view(body, 0, dtype=leaf.dtype, shape=leaf.shape)
            return header, tensor.requires_grad_() if leaf.requires_grad else tensor
        header = Header.decode(fields, description=frames.bytes(body, 0, described_bytes))
        leaves, offset = [], _aligned(described_bytes)
        for leaf in header.leaves:
            tensor = frames.view(body, offset, dtype=leaf.dtype, shape=leaf.shape)
            leaves.append(tensor.requires_grad_() if leaf.requires_grad else tensor)
            offset += _aligned(leaf.dtype.itemsize * tensor.numel())
        return header, unflatten(header.structure, leaves)


def _carrier(channel: Channel, frames: Frames) -> Callable[[Buffer], torch.Tensor | Buffer]:
    """What a frame's buffer goes to `channel` as: the host array itself where the channel takes arrays
    (`takes_arrays`: TCP, which writes and reads their bytes), else the tensor over it."""
    if getattr(channel, "takes_arrays", False) and isinstance(frames, HostFrames):
        return _same
    return frames.tensor


def _same(buffer: Buffer) -> Buffer:
    return buffer


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


class LocalChannel:
    """A one-direction in-memory channel (a queue of frame copies) for host frames."""

    def __init__(self, *, name: str, timeout_s: float) -> None:
        self.name = name
        self.device = "cpu"
        self.timeout_s = timeout_s
        self._queue: queue.Queue[bytes] = queue.Queue()

    def send(self, tensor: torch.Tensor) -> None:
        self._queue.put(tensor.numpy().tobytes())

    def try_send(self, tensor: torch.Tensor) -> int:
        self.send(tensor)  # the queue has no bound: all of it
        return tensor.numel()

    def recv(self, tensor: torch.Tensor) -> None:
        try:
            data = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"channel {self.name}: nothing received in {self.timeout_s:g} s") from None
        memoryview(tensor.numpy())[:] = data


def local_channels(*, layout: Layout, timeout_s: float) -> dict[Link, LocalChannel]:
    """One in-memory channel per directed link (both ends share the object)."""
    return {link: LocalChannel(name=str(link), timeout_s=timeout_s) for link in layout.links()}
