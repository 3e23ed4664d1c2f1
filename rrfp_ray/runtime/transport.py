"""Message framing and the channel interface; an in-memory channel for one-process runs.

A message is a fixed-size int64 header, then (unless it is STOP) its payload: a tree of
tensors (`rrfp_ray.runtime.tree`). A lone tensor's dtype and shape fit in the header.
Any other tree sends, after the header, a uint8 description (JSON: the tree's structure,
and each leaf's dtype, shape and whether it carries a gradient back), then its leaves,
one tensor each. The same framing runs over every channel (in memory, gloo, NCCL).
A `Channel` is one direction of one link; the collective implementation lives in
`actors/collective.py`, the in-memory one here.
"""

from __future__ import annotations

import enum
import json
import queue
from dataclasses import dataclass
from typing import Protocol

import torch

from rrfp_ray.runtime.tree import LEAF, Structure, Tree, flatten, unflatten
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.deps import Layout, Link, Message

HEADER_LEN = 16
_FIXED = 8  # code, virtual stage, microbatch, iteration, description bytes, dtype, ndim, requires grad
MAX_DIMS = HEADER_LEN - _FIXED  # a lone tensor with more dims travels with a description
_KIND_CODE = {Kind.F: 1, Kind.B: 2}
_STOP = 0
DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bool,
    torch.int8, torch.int16,
)
_WIRE = {torch.bool: torch.uint8}  # dtypes a collective may not carry travel as another of the same size


class LinkBackend(enum.Enum):
    """Which collective library carries the links: `auto` is NCCL where CUDA and cupy are
    present, else gloo (`actors/collective.py` resolves it)."""

    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


class Channel(Protocol):
    name: str
    device: str  # where the tensors it sends and receives live ("cpu" for gloo, "cuda" for NCCL)

    def send(self, tensor: torch.Tensor) -> None: ...

    def recv(self, tensor: torch.Tensor) -> None:
        """Fill `tensor` in place; raise TimeoutError naming the channel if nothing comes in time."""
        ...


@dataclass(frozen=True)
class Leaf:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool = False  # the receiver treats it as differentiable and sends its gradient back

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Leaf:
        if tensor.dtype not in DTYPES:
            raise ValueError(f"a {tensor.dtype} tensor cannot cross a stage boundary; dtypes: {DTYPES}")
        return cls(dtype=tensor.dtype, shape=tuple(tensor.shape), requires_grad=tensor.requires_grad)


@dataclass(frozen=True)
class Header:
    message: Message | None  # None: STOP
    iteration: int = 0
    structure: Structure = LEAF
    leaves: tuple[Leaf, ...] = (Leaf(dtype=torch.float32, shape=()),)

    def description(self) -> bytes:
        """Empty for a lone tensor that fits in the header; else the JSON that follows it."""
        if self.structure == LEAF and len(self.leaves[0].shape) <= MAX_DIMS:
            return b""
        leaves = [[DTYPES.index(leaf.dtype), int(leaf.requires_grad), list(leaf.shape)] for leaf in self.leaves]
        return json.dumps({"tree": self.structure, "leaves": leaves}, separators=(",", ":")).encode()

    def encode(self) -> torch.Tensor:
        fields = [_STOP] + [0] * (HEADER_LEN - 1)
        if self.message is not None:
            m, described = self.message, self.description()
            fields = [_KIND_CODE[m.kind], m.virtual_stage, m.microbatch, self.iteration, len(described)]
            leaf = self.leaves[0] if not described else Leaf(dtype=torch.float32, shape=())
            fields += [DTYPES.index(leaf.dtype), len(leaf.shape), int(leaf.requires_grad)]
            fields += list(leaf.shape) + [0] * (MAX_DIMS - len(leaf.shape))
        return torch.tensor(fields, dtype=torch.int64)

    @classmethod
    def decode(cls, data: torch.Tensor, *, description: bytes = b"") -> Header:
        code, vs, mb, iteration, _, dtype, ndim, grad, *shape = (int(x) for x in data.tolist())
        if code == _STOP:
            return cls(message=None)
        kind = Kind.F if code == _KIND_CODE[Kind.F] else Kind.B
        message = Message(kind=kind, virtual_stage=vs, microbatch=mb)
        if not description:
            leaf = Leaf(dtype=DTYPES[dtype], shape=tuple(shape[:ndim]), requires_grad=bool(grad))
            return cls(message=message, iteration=iteration, leaves=(leaf,))
        spec = json.loads(description)
        leaves = tuple(Leaf(dtype=DTYPES[d], shape=tuple(s), requires_grad=bool(g)) for d, g, s in spec["leaves"])
        return cls(message=message, iteration=iteration, structure=spec["tree"], leaves=leaves)

    @staticmethod
    def description_bytes(data: torch.Tensor) -> int:
        return int(data[4])

    @classmethod
    def for_payload(cls, *, message: Message, iteration: int, payload: Tree) -> Header:
        tensors, structure = flatten(payload)
        return cls(message=message, iteration=iteration, structure=structure, leaves=tuple(Leaf.of(t) for t in tensors))

    @property
    def is_stop(self) -> bool:
        return self.message is None


def send_message(*, channel: Channel, header: Header, payload: Tree | None) -> None:
    channel.send(header.encode().to(channel.device))
    described = b"" if header.is_stop else header.description()
    if described:
        channel.send(torch.frombuffer(bytearray(described), dtype=torch.uint8).to(channel.device))
    if payload is not None:
        for tensor in flatten(payload)[0]:
            wire = tensor.detach().to(channel.device).contiguous()
            channel.send(wire.to(_WIRE.get(wire.dtype, wire.dtype)))


def recv_message(*, channel: Channel) -> tuple[Header, Tree | None]:
    header = recv_header(channel=channel)
    return header, recv_payload(channel=channel, header=header)


def recv_header(*, channel: Channel) -> Header:
    """The next message's header (and description, if it has one); its payload follows (`recv_payload`)."""
    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=channel.device)
    channel.recv(raw)
    raw = raw.cpu()
    described = b""
    if int(raw[0]) != _STOP and Header.description_bytes(raw):
        data = torch.empty(Header.description_bytes(raw), dtype=torch.uint8, device=channel.device)
        channel.recv(data)
        described = bytes(data.cpu().tolist())
    return Header.decode(raw, description=described)


def recv_payload(*, channel: Channel, header: Header) -> Tree | None:
    """The payload `header` announced (None for STOP)."""
    if header.is_stop:
        return None
    leaves = []
    for leaf in header.leaves:
        tensor = torch.empty(leaf.shape, dtype=_WIRE.get(leaf.dtype, leaf.dtype), device=channel.device)
        channel.recv(tensor)
        leaves.append(tensor.to(leaf.dtype).requires_grad_(leaf.requires_grad))
    return unflatten(header.structure, leaves)


class LocalChannel:
    """A one-direction in-memory channel (a queue of tensor copies)."""

    def __init__(self, *, name: str, timeout_s: float) -> None:
        self.name = name
        self.device = "cpu"
        self.timeout_s = timeout_s
        self._queue: queue.Queue[torch.Tensor] = queue.Queue()

    def send(self, tensor: torch.Tensor) -> None:
        self._queue.put(tensor.detach().clone())

    def recv(self, tensor: torch.Tensor) -> None:
        try:
            data = self._queue.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(f"channel {self.name}: nothing received in {self.timeout_s:g} s") from None
        tensor.copy_(data.view_as(tensor))


def local_channels(*, layout: Layout, timeout_s: float) -> dict[Link, LocalChannel]:
    """One in-memory channel per directed link (both ends share the object)."""
    return {link: LocalChannel(name=str(link), timeout_s=timeout_s) for link in layout.links()}
