"""Message framing and the channel interface; an in-memory channel for one-process runs.

Every message is a fixed-size int64 header, then (unless it is STOP) the payload tensor.
A `Channel` is one direction of one link; the collective implementation lives in
`actors/collective.py`, the in-memory one here.
"""

from __future__ import annotations

import enum
import queue
from dataclasses import dataclass
from typing import Protocol

import torch

from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.deps import Layout, Link, Message

HEADER_LEN = 16
MAX_DIMS = HEADER_LEN - 6
_KIND_CODE = {Kind.F: 1, Kind.B: 2}
_STOP = 0
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8)


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
class Header:
    message: Message | None  # None: STOP
    iteration: int = 0
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] = ()

    def encode(self) -> torch.Tensor:
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"payload has {len(self.shape)} dims; the header holds at most {MAX_DIMS}")
        fields = [_STOP, 0, 0, 0, 0, 0]
        if self.message is not None:
            m = self.message
            fields = [_KIND_CODE[m.kind], m.virtual_stage, m.microbatch, self.iteration, DTYPES.index(self.dtype), len(self.shape)]
        fields += list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        return torch.tensor(fields, dtype=torch.int64)

    @classmethod
    def decode(cls, data: torch.Tensor) -> Header:
        code, vs, mb, iteration, dtype, ndim, *shape = (int(x) for x in data.tolist())
        if code == _STOP:
            return cls(message=None)
        kind = Kind.F if code == _KIND_CODE[Kind.F] else Kind.B
        return cls(
            message=Message(kind=kind, virtual_stage=vs, microbatch=mb),
            iteration=iteration,
            dtype=DTYPES[dtype],
            shape=tuple(shape[:ndim]),
        )

    @classmethod
    def for_payload(cls, *, message: Message, iteration: int, payload: torch.Tensor) -> Header:
        return cls(message=message, iteration=iteration, dtype=payload.dtype, shape=tuple(payload.shape))

    @property
    def is_stop(self) -> bool:
        return self.message is None


def send_message(*, channel: Channel, header: Header, payload: torch.Tensor | None) -> None:
    channel.send(header.encode().to(channel.device))
    if payload is not None:
        channel.send(payload.detach().to(channel.device).contiguous())


def recv_message(*, channel: Channel) -> tuple[Header, torch.Tensor | None]:
    raw = torch.empty(HEADER_LEN, dtype=torch.int64, device=channel.device)
    channel.recv(raw)
    header = Header.decode(raw.cpu())
    if header.is_stop:
        return header, None
    payload = torch.empty(header.shape, dtype=header.dtype, device=channel.device)
    channel.recv(payload)
    return header, payload


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
