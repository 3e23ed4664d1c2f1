"""Building and reading a message's frame (`rrfp_ray.runtime.transport`) in host or device memory.

Host frames are numpy arrays written and read through views, `struct` and a `ctypes` copy,
so a link thread makes no torch op while it frames a message: almost every torch op gives up
the GIL and takes it back, and each time the thread queues behind whichever other thread of
its stage runs Python, up to the interpreter's 5 ms switch interval. On 2 CPUs one 16 KB
message framed and read back over torch ops took 211 us alone
and 22 ms beside one busy Python thread, host frames 91 us and 1.4 ms (medians of
`python jobs/bench_framing.py --messages 1000`). Device frames (NCCL)
are torch tensors on the GPU, written with torch ops.

Both lay out the same bytes, so a frame built either way reads back either way.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

HEADER_LEN = 19  # int64 fields
HEADER_BYTES = HEADER_LEN * 8
_HEADER = struct.Struct(f"<{HEADER_LEN}q")
_NUMPY = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.uint8: np.uint8,
    torch.bool: np.bool_,
    torch.int8: np.int8,
    torch.int16: np.int16,
}
_BITS = {torch.bfloat16: np.int16}  # no numpy dtype: the bits travel as this one and are viewed back

Buffer = Any  # a numpy uint8 array (host frames) or a torch uint8 tensor (device frames)


class Frames(Protocol):
    def empty(self, nbytes: int) -> Buffer: ...

    def tensor(self, buffer: Buffer) -> torch.Tensor:
        """The buffer as the uint8 tensor a channel sends or fills (its memory, shared)."""
        ...

    def tail(self, buffer: Buffer, start: int) -> Buffer: ...

    def put_header(self, buffer: Buffer, fields: Sequence[int]) -> None: ...

    def header(self, buffer: Buffer) -> tuple[int, ...]: ...

    def put_bytes(self, buffer: Buffer, offset: int, data: bytes) -> None: ...

    def bytes(self, buffer: Buffer, offset: int, size: int) -> bytes: ...

    def put_tensor(self, buffer: Buffer, offset: int, tensor: torch.Tensor) -> None: ...

    def view(self, buffer: Buffer, offset: int, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of `dtype` and `shape` over the buffer's bytes from `offset` (shared, no copy)."""
        ...


class HostFrames:
    def empty(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def tensor(self, buffer: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(buffer)

    def tail(self, buffer: np.ndarray, start: int) -> np.ndarray:
        return buffer[start:]

    def put_header(self, buffer: np.ndarray, fields: Sequence[int]) -> None:
        _HEADER.pack_into(buffer, 0, *fields)

    def header(self, buffer: np.ndarray) -> tuple[int, ...]:
        return _HEADER.unpack_from(buffer, 0)

    def put_bytes(self, buffer: np.ndarray, offset: int, data: bytes) -> None:
        buffer[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def bytes(self, buffer: np.ndarray, offset: int, size: int) -> bytes:
        return buffer[offset : offset + size].tobytes()

    def put_tensor(self, buffer: np.ndarray, offset: int, tensor: torch.Tensor) -> None:
        if not tensor.is_cpu:
            tensor = tensor.detach().cpu()
        if not tensor.is_contiguous():
            tensor = tensor.detach().contiguous()
        size = tensor.nbytes
        if size:  # the tensor stays referenced while its memory is read
            source = (ctypes.c_char * size).from_address(tensor.data_ptr())
            buffer[offset : offset + size] = np.frombuffer(source, dtype=np.uint8)

    def view(self, buffer: np.ndarray, offset: int, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        carrier = _NUMPY.get(dtype) or _BITS[dtype]
        size = dtype.itemsize * math.prod(shape)
        tensor = torch.from_numpy(buffer[offset : offset + size].view(carrier).reshape(shape))
        return tensor if dtype in _NUMPY else tensor.view(dtype)


class DeviceFrames:
    def __init__(self, *, device: str) -> None:
        self.device = device

    def empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def tensor(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer

    def tail(self, buffer: torch.Tensor, start: int) -> torch.Tensor:
        return buffer[start:]

    def put_header(self, buffer: torch.Tensor, fields: Sequence[int]) -> None:
        buffer[:HEADER_BYTES] = torch.tensor(list(fields), dtype=torch.int64).view(torch.uint8).to(self.device)

    def header(self, buffer: torch.Tensor) -> tuple[int, ...]:
        return tuple(buffer[:HEADER_BYTES].cpu().view(torch.int64).tolist())

    def put_bytes(self, buffer: torch.Tensor, offset: int, data: bytes) -> None:
        buffer[offset : offset + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)

    def bytes(self, buffer: torch.Tensor, offset: int, size: int) -> bytes:
        return bytes(buffer[offset : offset + size].cpu().numpy())

    def put_tensor(self, buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> None:
        flat = tensor.detach().to(self.device).contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()] = flat

    def view(self, buffer: torch.Tensor, offset: int, *, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        size = dtype.itemsize * math.prod(shape)
        return buffer[offset : offset + size].view(dtype).view(shape)


def frames_for(device: str) -> Frames:
    """Host frames for a channel whose tensors live on the CPU, device frames otherwise."""
    return HostFrames() if torch.device(device).type == "cpu" else DeviceFrames(device=device)
