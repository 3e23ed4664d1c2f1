"""The NCCL side of our channels and collectives: every use of Ray's NCCL group internals is here.

`ray.util.collective`'s NCCL group only enqueues its ops on streams of its own (cupy streams),
so waiting for an op to finish means finding that stream: that lives in private attributes
(`_dev_streams_map`, `_get_comm_key_send_recv`), written against Ray `WRITTEN_AGAINST`; on
another Ray the NCCL path is refused with a clear error rather than guessed at (gloo is not affected).

One thread per communicator: a link's 2-rank group carries one direction and is used by one
link thread only, and the TP group and the all-stages group by the compute thread only (see
`rrfp_ray.runtime.worker`); `OneThread` enforces it where ops are issued.
"""

from __future__ import annotations

import threading
import time

import ray
import torch
from ray.util.collective import types

WRITTEN_AGAINST = (2, 60)
_POLL_S = 50e-6


def check_ray_version() -> None:
    found = tuple(int(part) for part in ray.__version__.split(".")[:2])
    if found != WRITTEN_AGAINST:
        raise RuntimeError(
            f"the NCCL links use Ray {'.'.join(map(str, WRITTEN_AGAINST))}'s NCCL group internals; this is Ray "
            f"{ray.__version__}: pin ray=={'.'.join(map(str, WRITTEN_AGAINST))}.* or use backend gloo"
        )


class OneThread:
    """Remembers the first thread that issues an op on a communicator and refuses any other:
    two threads enqueueing on one NCCL communicator can order their ops differently on the
    two ranks, which hangs both."""

    def __init__(self, *, what: str) -> None:
        self.what = what
        self._owner: int | None = None

    def check(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError(
                f"{self.what}: ops from a second thread ({threading.current_thread().name}); "
                "one thread per communicator"
            )


def transfer(*, handle, op: str, tensor: torch.Tensor, peer: int, timeout_s: float, where: str) -> None:
    """Send or receive `tensor` on Ray's NCCL group `handle` and wait (bounded) until it is done."""
    from ray.util.collective.collective_group import nccl_collective_group

    check_ray_version()
    if op == "send":
        options = types.SendOptions()
        options.dst_rank = peer
        handle.send([tensor], options)
    else:
        options = types.RecvOptions()
        options.src_rank = peer
        handle.recv([tensor], options)
    # The pair's stream, keyed as Ray keys it (the peer's GPU index is the option's default, 0).
    key = nccl_collective_group._get_comm_key_send_recv(handle.rank, tensor.device.index, peer, 0)
    _await_stream(
        stream=handle._dev_streams_map[key][0],
        device=tensor.device.index,
        timeout_s=timeout_s,
        what=f"{where}: {op} did not complete within {timeout_s}s",
    )


def settle_collective(*, handle, tensor: torch.Tensor) -> None:
    """Wait until a collective's result in `tensor` is readable."""
    check_ray_version()
    handle._dev_streams_map[str(tensor.device.index)][0].synchronize()  # keyed by the devices' indices


def _await_stream(*, stream, device: int, timeout_s: float, what: str) -> None:
    import cupy

    with cupy.cuda.Device(device):
        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(stream)
    deadline = time.monotonic() + timeout_s
    while not event.done:
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(_POLL_S)
