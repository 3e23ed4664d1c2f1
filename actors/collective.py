"""Collective groups for stage actors, over ``ray.util.collective``.

Collective libraries (Ray registers each as a "backend"):
- ``rrfp_gloo`` (CPU, tests): our own registered backend holding one
  ``ProcessGroupGloo`` per group. Ray's built-in GLOO backend uses torch's default
  process group, so an actor could join only one group with it.
- ``nccl`` (GPUs): ray.util.collective's NCCL group. cupy is imported only on that path.

Setup is two-phase so a driver can wire many groups without deadlock: ``host_group``
on rank 0 returns an address, then every rank calls ``join_group`` (the gloo
rendezvous blocks until all ranks of the group have joined).
"""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import ray
import ray.util.collective as col
import torch
import torch.distributed as dist
from ray.util.collective import types
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from actors import nccl_channel
from rrfp_ray.runtime.transport import LinkTransport

GLOO_BACKEND = "rrfp_gloo"
NCCL_BACKEND = "nccl"
# The first Ray with ray.util.collective.backend_registry (pyproject.toml declares the same floor).
RAY_FLOOR = (2, 56)
if tuple(int(part) for part in ray.__version__.split(".")[:2]) < RAY_FLOOR:
    raise ImportError(f"actors.collective needs ray >= {'.'.join(map(str, RAY_FLOOR))}, found {ray.__version__}")

_TORCH_REDUCE_OPS = {
    types.ReduceOp.SUM: dist.ReduceOp.SUM,
    types.ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    types.ReduceOp.MIN: dist.ReduceOp.MIN,
    types.ReduceOp.MAX: dist.ReduceOp.MAX,
}


class _SetupTable:
    """What this process holds between the steps of a group's setup.

    ``host_group`` and ``join_group`` are separate actor calls, and ray.util.collective
    builds a backend from ``(world_size, rank, group_name)`` only, so the hosted store
    and the connected process group wait here, keyed by group name.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.hosted: dict[str, dist.TCPStore] = {}
        self.connected: dict[str, tuple[dist.ProcessGroupGloo, dist.TCPStore]] = {}

    def host(self, *, name: str, store: dist.TCPStore) -> None:
        with self.lock:
            if name in self.hosted:
                raise ValueError(f"name={name!r}: this process already hosts that group")
            self.hosted[name] = store

    def take_hosted(self, *, name: str) -> dist.TCPStore:
        with self.lock:
            if name not in self.hosted:
                raise ValueError(f"name={name!r}: rank 0 must call host_group in this process before join_group")
            return self.hosted.pop(name)

    def drop_hosted(self, *, name: str) -> None:
        with self.lock:
            self.hosted.pop(name, None)

    def put_connected(self, *, name: str, group: dist.ProcessGroupGloo, store: dist.TCPStore) -> None:
        with self.lock:
            self.connected[name] = (group, store)

    def take_connected(self, *, name: str) -> tuple[dist.ProcessGroupGloo, dist.TCPStore]:
        with self.lock:
            if name not in self.connected:
                raise RuntimeError(
                    f"group {name!r}: create {GLOO_BACKEND} groups with join_group, "
                    "not with ray.util.collective directly"
                )
            return self.connected.pop(name)


_SETUP = _SetupTable()


class GlooGroup(BaseGroup):
    """A ray.util.collective group backed by its own ``ProcessGroupGloo``.

    Every op waits at most the group's timeout (``join_group``'s ``timeout_s``).
    """

    def __init__(self, world_size: int, rank: int, group_name: str):
        super().__init__(world_size, rank, group_name)
        # The store stays referenced for the group's lifetime: on rank 0 it is the server.
        self.process_group, self._store = _SETUP.take_connected(name=group_name)

    @classmethod
    def backend(cls) -> str:
        return GLOO_BACKEND.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        return dist.is_gloo_available()

    def allreduce(self, tensor, allreduce_options: types.AllReduceOptions | None = None) -> None:
        if allreduce_options is None:
            allreduce_options = types.AllReduceOptions()
        op = _TORCH_REDUCE_OPS[allreduce_options.reduceOp]
        self.process_group.allreduce(tensor, op).wait()

    def allgather(self, tensor_list, tensor, allgather_options: types.AllGatherOptions | None = None) -> None:
        self.process_group.allgather(tensor_list, tensor).wait()

    def barrier(self, barrier_options: types.BarrierOptions | None = None) -> None:
        self.process_group.barrier().wait()

    def send(self, tensor, send_options: types.SendOptions) -> None:
        self.process_group.send(tensor, send_options.dst_rank, 0).wait()

    def recv(self, tensor, recv_options: types.RecvOptions) -> None:
        self.process_group.recv(tensor, recv_options.src_rank, 0).wait()

    def reduce(self, tensor, reduce_options: types.ReduceOptions | None = None) -> None:
        if reduce_options is None:
            reduce_options = types.ReduceOptions()
        options = dist.ReduceOptions()
        options.reduceOp = _TORCH_REDUCE_OPS[reduce_options.reduceOp]
        options.rootRank = reduce_options.root_rank
        self.process_group.reduce(tensor, options).wait()

    def broadcast(self, tensor, broadcast_options: types.BroadcastOptions | None = None) -> None:
        raise NotImplementedError(f"{GLOO_BACKEND} has no broadcast; use send/recv")

    def reducescatter(
        self, tensor, tensor_list, reducescatter_options: types.ReduceScatterOptions | None = None
    ) -> None:
        raise NotImplementedError(f"{GLOO_BACKEND} has no reducescatter; use allreduce")


def register_backends() -> None:
    """Register the gloo backend in this process (driver and every actor); idempotent."""
    with _SETUP.lock:
        if not col.is_backend_available(GLOO_BACKEND):
            col.register_collective_backend(GLOO_BACKEND, GlooGroup)


def nccl_missing() -> str | None:
    """What this process lacks for NCCL links (a visible CUDA device, cupy), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "cupy is not installed (pip install 'rrfp-ray[gpu]')"
    return None


def resolve_transport(*, transport: LinkTransport) -> LinkTransport:
    """What carries the links, as this process sees it: ``auto`` is NCCL when it sees CUDA and cupy
    imports, else TCP (a message costs a fraction of a gloo pair's: `rrfp_ray.runtime.tcp_channel`);
    ``nccl`` without them is an error. Every stage actor resolves it where it runs (the driver
    sits on a CPU head); `agree_on_transport` checks the answers."""
    if not isinstance(transport, LinkTransport):
        raise TypeError(f"transport must be a LinkTransport, got {transport!r}")
    missing = nccl_missing()
    if transport is LinkTransport.NCCL and missing is not None:
        raise RuntimeError(f"backend nccl: {missing}")
    if transport is not LinkTransport.AUTO:
        return transport
    return LinkTransport.NCCL if missing is None else LinkTransport.TCP


def group_library(*, links: LinkTransport) -> LinkTransport:
    """The collective library (``join_group``'s) of the groups beside links on ``links`` (resolved): gloo under TCP
    links."""
    return LinkTransport.GLOO if links is LinkTransport.TCP else links


def agree_on_transport(*, choices: dict[str, LinkTransport]) -> LinkTransport:
    """The one link transport every stage resolved (`choices`: stage label -> its answer); a mix is
    an error naming the stages on each side (e.g. some stages landed on nodes without a GPU)."""
    found = set(choices.values())
    if len(found) == 1:
        return found.pop()
    sides = "; ".join(
        f"{transport.value} on {', '.join(label for label, b in choices.items() if b is transport)}"
        for transport in sorted(found, key=lambda b: b.value)
    )
    raise RuntimeError(
        f"the stages resolved different link transports ({sides}): give every stage a GPU, or pass backend tcp or gloo"
    )


def host_group(*, name: str) -> str:
    """On rank 0: open the group's rendezvous store on the node's address and return its ``host:port``.

    The store serves until the group is gone (its process group holds it; torch has no way
    to close it sooner), and like all of torch.distributed it authenticates no one.
    """
    host = ray.util.get_node_ip_address()
    # A TCPStore binds every interface unless handed a bound socket; it owns the socket from here.
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    # wait_for_workers=False: the store must exist before its address is published.
    store = dist.TCPStore(
        host,
        listener.getsockname()[1],
        None,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    _SETUP.host(name=name, store=store)
    return f"{host}:{store.port}"


def join_group(
    *, name: str, address: str, rank: int, world_size: int, library: LinkTransport, timeout_s: float
) -> None:
    """On every rank (0 included): join group ``name``; blocks until all ranks join (gloo).

    ``address`` is rank 0's ``host_group`` answer; NCCL ignores it (Ray's NCCL group
    meets through a named actor on first use). An actor runs its calls one at a time,
    so a driver issues the joins of all groups at once, in one group order for every
    actor, then waits for them all.
    """
    if library not in (LinkTransport.GLOO, LinkTransport.NCCL):
        raise ValueError(
            f"library must be LinkTransport.GLOO or LinkTransport.NCCL (see group_library), got {library!r}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    if library is LinkTransport.NCCL:
        if not col.nccl_available():
            raise RuntimeError(f"group {name!r}: backend 'nccl' needs cupy and a GPU here")
        nccl_channel.check_ray_version()
        col.init_collective_group(world_size, rank, backend=NCCL_BACKEND, group_name=name)
        return
    register_backends()
    if col.is_group_initialized(name):
        raise ValueError(f"name={name!r}: this process already joined that group")
    timeout = timedelta(seconds=timeout_s)
    options = dist.ProcessGroupGloo._Options()
    # The node's Ray address, not the hostname gloo would guess (may be loopback).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=ray.util.get_node_ip_address())]
    options._timeout = timeout
    try:
        if rank == 0:
            store = _SETUP.take_hosted(name=name)
        else:
            host, port = address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), None, is_master=False, timeout=timeout)
        # Connected outside ray.util.collective's process-wide lock, which this
        # rendezvous would otherwise hold while it waits for the other ranks.
        group = dist.ProcessGroupGloo(store, rank, world_size, options)
    except RuntimeError as error:
        raise RuntimeError(
            f"group {name!r}: rank {rank} of {world_size} could not join at {address}: {error}"
        ) from error
    _SETUP.put_connected(name=name, group=group, store=store)
    col.init_collective_group(world_size, rank, backend=GLOO_BACKEND, group_name=name)


def destroy_group(*, name: str) -> None:
    """Leave group ``name`` in this process (a no-op for a group never joined here).

    It does not unblock a send/recv waiting on the group in another thread.
    """
    _SETUP.drop_hosted(name=name)
    if col.is_group_initialized(name):
        col.destroy_collective_group(name)


class Channel:
    """One direction of a 2-rank group: this rank sends to, or receives from, ``peer``.

    One thread per channel, enforced (`nccl_channel.OneThread`). A CUDA tensor given to ``send`` must be complete
    (its producing stream synchronised); ``recv`` returns with the data in place.
    After a timeout or a peer failure the group is broken: rebuild it.
    """

    def __init__(self, *, group: str, peer: int, timeout_s: float, name: str):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._handle = col.get_group_handle(group)
        if peer == self._handle.rank or not 0 <= peer < self._handle.world_size:
            raise ValueError(
                f"peer must be another rank of group {group!r} "
                f"(size {self._handle.world_size}, this rank {self._handle.rank}), got {peer}"
            )
        self._group = group
        self._peer = peer
        self._timeout_s = timeout_s
        self.name = name
        self.device = "cpu" if isinstance(self._handle, GlooGroup) else "cuda"  # where its tensors must live
        self._thread = nccl_channel.OneThread(what=f"channel {name!r} (group {group!r})")

    def send(self, tensor: torch.Tensor) -> None:
        self._transfer(op="send", tensor=tensor)

    def recv(self, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` in place with the peer's next message."""
        self._transfer(op="recv", tensor=tensor)

    def _transfer(self, *, op: str, tensor: torch.Tensor) -> None:
        where = f"channel {self.name!r} (group {self._group!r}, peer rank {self._peer})"
        self._thread.check()
        if isinstance(self._handle, GlooGroup):
            _gloo_transfer(
                group=self._handle.process_group,
                op=op,
                tensor=tensor,
                peer=self._peer,
                timeout_s=self._timeout_s,
                where=where,
            )
        else:
            nccl_channel.transfer(
                handle=self._handle,
                op=op,
                tensor=tensor,
                peer=self._peer,
                timeout_s=self._timeout_s,
                where=where,
            )


def all_reduce_sum(*, group: str, tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over all ranks of ``group``, in place."""
    handle = col.get_group_handle(group)
    options = types.AllReduceOptions()
    options.reduceOp = types.ReduceOp.SUM
    handle.allreduce([tensor], options)
    _settle_collective(handle=handle, tensor=tensor)


def reduce_sum(*, group: str, tensor: torch.Tensor, dst: int) -> bool:
    """Sum ``tensor`` over all ranks of ``group`` into rank ``dst``'s, in place; True on ``dst``
    (elsewhere ``tensor`` is left undefined: the backend may use it as scratch)."""
    handle = col.get_group_handle(group)
    options = types.ReduceOptions()
    options.reduceOp = types.ReduceOp.SUM
    options.root_rank = dst
    handle.reduce([tensor], options)
    _settle_collective(handle=handle, tensor=tensor)
    return handle.rank == dst


def all_gather_ints(*, group: str, values: list[int], device: str) -> list[list[int]]:
    """Every rank's `values` (the same length on every rank), in rank order, over `group`;
    `device`: where the ids travel ("cuda" for NCCL)."""
    handle = col.get_group_handle(group)
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(handle.world_size)]
    handle.allgather([rows], [mine], types.AllGatherOptions())
    _settle_collective(handle=handle, tensor=mine)
    return [row.tolist() for row in rows]


def _gloo_transfer(
    *,
    group: dist.ProcessGroupGloo,
    op: str,
    tensor: torch.Tensor,
    peer: int,
    timeout_s: float,
    where: str,
) -> None:
    work = group.send([tensor], peer, 0) if op == "send" else group.recv([tensor], peer, 0)
    try:
        work.wait(timedelta(seconds=timeout_s))
    except RuntimeError as error:
        # gloo: "Timed out waiting <ms>ms for <op> operation to complete"; a timeout
        # also closes the pair, so the peer's pending op fails as well.
        if "Timed out" in str(error):
            raise TimeoutError(f"{where}: {op} did not complete within {timeout_s}s") from error
        raise ConnectionError(f"{where}: {op} failed: {error}") from error


def _settle_collective(*, handle, tensor: torch.Tensor) -> None:
    """Wait until the collective's result is readable (gloo ops already waited)."""
    if not isinstance(handle, GlooGroup):
        nccl_channel.settle_collective(handle=handle, tensor=tensor)
