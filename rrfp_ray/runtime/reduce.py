"""Data parallelism's gradient reduction on one stage: buckets of final gradients summed over
the stage's DP group (the same stage and TP rank in every replica) on a communication thread
of its own, while the stage's compute thread runs its other ops.

A chunk's gradients are handed over in parts (`add`) as they become final during its last
weight-gradient op, then the chunk is marked complete (`complete`); `submit` hands over a whole
chunk at once. A bucket is summed as soon as its gradients are in (`Bucketer`: the buckets
depend on the gradients' order alone, not on the parts). Every replica must sum the same
buckets in the same order, whatever order its chunks finished in: the thread reduces chunks in a
fixed order (`order`), waiting for the next one's turn, and each chunk's gradients come in the
executor's fixed order. The optimizer step waits for every bucket (`wait`).

With ZeRO-1 each gradient has an owner, the replica that steps its parameter: a chunk's
gradients are bucketed by owner and each bucket is reduced to its owner alone (together a
reduce-scatter), so the other replicas keep their own unreduced gradients of it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rrfp_ray.runtime.streams import Fence, Handoff
from rrfp_ray.schedule.actions import Action
from rrfp_ray.schedule.grad_ready import Bucketer, completes_weights

logger = logging.getLogger(__name__)

AllReduce = Callable[[Tensor], Tensor]  # the sum of a tensor over the DP group (returned; the input may be reused)
ReduceTo = Callable[[Tensor, int], Tensor | None]  # the sum at replica `dst`: returned there, None on the others


@dataclass(frozen=True)
class ChunkGradients:
    """A chunk's final gradients. `owners[i]`: the replica that alone needs the sum of `tensors[i]`
    (ZeRO-1; None: every replica, e.g. a tied parameter's, which is summed over stages afterwards);
    `owners` None: every replica needs every sum."""

    tensors: list[Tensor]
    owners: list[int | None] | None = None

    def __post_init__(self) -> None:
        if self.owners is not None and len(self.owners) != len(self.tensors):
            raise ValueError(f"{len(self.owners)} owners for {len(self.tensors)} gradients")

    def with_owners(self) -> list[tuple[Tensor, int | None]]:
        return list(zip(self.tensors, self.owners or [None] * len(self.tensors), strict=True))


GradSink = Callable[[ChunkGradients], None]  # takes a part of a chunk's gradients, final now


@dataclass(frozen=True)
class ReduceStats:
    busy_ms: float  # time spent in the group's reductions
    end_s: float  # time.perf_counter() when the last bucket was summed (0: nothing to reduce)
    nbytes: int  # bytes this replica contributed to the sums
    received: int  # bytes of sums this replica received (nbytes; with ZeRO-1 about nbytes / D)


def buckets(tensors: Sequence[Tensor], *, bucket_bytes: int) -> list[list[Tensor]]:
    """`tensors` in order, grouped into runs of one dtype of at most `bucket_bytes` (a bigger tensor alone)."""
    bucketer: Bucketer[Tensor] = Bucketer(bucket_bytes=bucket_bytes)
    groups = [group for tensor in tensors for group in bucketer.add(tensor, nbytes=_nbytes(tensor), kind=tensor.dtype)]
    return groups + bucketer.flush()


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class GradReducer:
    """Sums the gradients handed over each iteration over the DP group, in place, bucket by bucket,
    on a thread of its own. `order`: the keys (chunks) of an iteration in the order every replica
    reduces them. Gradients with an owner are summed with `reduce_to` (ZeRO-1): only the owner's
    are replaced by the sum."""

    def __init__(
        self,
        *,
        all_reduce: AllReduce,
        order: Sequence[int],
        bucket_bytes: int,
        timeout_s: float,
        name: str,
        reduce_to: ReduceTo | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self._all_reduce = all_reduce
        self._reduce_to = reduce_to
        self._order = list(order)
        self._bucket_bytes = bucket_bytes
        self._timeout_s = timeout_s
        self._name = name
        self._handoff = Handoff()
        self._bucketer: Bucketer[tuple[Tensor, int | None]] = Bucketer(bucket_bytes=bucket_bytes)
        self._cond = threading.Condition()
        self._parts: dict[int, list[tuple[ChunkGradients, Fence]]] = {}  # key: the parts handed over so far
        self._complete: set[int] = set()
        self._next = len(self._order)  # index into order of the chunk to reduce next; all done until begin
        self._taken = 0  # parts of that chunk the thread has taken
        self._busy = 0.0
        self._end = 0.0
        self._nbytes = 0
        self._received = 0
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"reduce {name}", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        """A new iteration: nothing handed over, nothing reduced."""
        with self._cond:
            self._raise_if_failed()
            self._parts.clear()
            self._complete.clear()
            self._bucketer = Bucketer(bucket_bytes=self._bucket_bytes)  # nothing left of an iteration cut short
            self._next, self._taken, self._busy, self._end, self._nbytes, self._received = 0, 0, 0.0, 0.0, 0, 0
            self._cond.notify_all()

    def add(self, *, key: int, part: ChunkGradients) -> None:
        """Some of `key`'s gradients are final (on the caller's thread, right after they were made):
        sum them over the group (in place) when their turn comes, each bucket once its gradients are in."""
        if part.owners is not None and any(o is not None for o in part.owners) and self._reduce_to is None:
            raise ValueError(f"{self._name}: gradients with owners (ZeRO-1) need a reducer built with reduce_to")
        fence = self._handoff.produced(part.tensors)
        with self._cond:
            if key in self._complete:
                raise RuntimeError(f"{self._name}: chunk {key}'s gradients were handed over after it was complete")
            self._parts.setdefault(key, []).append((part, fence))
            self._cond.notify_all()

    def sink(self, *, key: int) -> GradSink:
        """Where an executor hands `key`'s gradients in parts (`add`) during its last weight-gradient op."""
        return lambda part: self.add(key=key, part=part)

    def complete(self, *, key: int) -> None:
        """Every gradient of `key` was handed over."""
        with self._cond:
            if key in self._complete:
                raise RuntimeError(f"{self._name}: chunk {key} was completed twice in one iteration")
            self._complete.add(key)
            self._cond.notify_all()

    def submit(self, *, key: int, grads: ChunkGradients) -> None:
        """`key`'s gradients, all final now."""
        self.add(key=key, part=grads)
        self.complete(key=key)

    def wait(self) -> ReduceStats:
        """Every chunk of the iteration summed; raises naming the chunk it waited for past the timeout."""
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while self._next < len(self._order):
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    key = self._order[self._next]
                    state = "another replica did not join its sum" if key in self._complete else "not complete"
                    raise TimeoutError(
                        f"{self._name}: the DP reduction of chunk {key} did not finish within {self._timeout_s:g} s "
                        f"({state}; {len(self._parts.get(key, []))} part(s) handed over)"
                    )
                self._cond.wait(timeout=left)
            self._raise_if_failed()
            return ReduceStats(busy_ms=self._busy * 1e3, end_s=self._end, nbytes=self._nbytes, received=self._received)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=self._timeout_s)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"{self._name}: the DP reduction failed: {self._error}") from self._error

    def _work(self) -> tuple[list[tuple[ChunkGradients, Fence]], bool] | None:
        """Under the lock: the running chunk's parts not yet taken, and whether they end it; None: nothing to do."""
        if self._next >= len(self._order):
            return None
        key = self._order[self._next]
        parts = self._parts.get(key, [])[self._taken :]
        last = key in self._complete
        return (parts, last) if parts or last else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (work := self._work()) is None:
                    self._cond.wait()
                if self._closed:
                    return
                parts, last = work
                self._taken += len(parts)
                bucketer = self._bucketer
            try:
                began = time.perf_counter()
                groups = []
                for part, fence in parts:
                    self._handoff.before_send(fence)
                    for tensor, owner in part.with_owners():
                        groups += bucketer.add((tensor, owner), nbytes=_nbytes(tensor), group=owner, kind=tensor.dtype)
                nbytes, received = self._reduce(groups + (bucketer.flush() if last else []))
                ended = time.perf_counter()
            except BaseException as error:  # reported to the compute thread by wait()
                with self._cond:
                    self._error = error
                    self._cond.notify_all()
                return
            with self._cond:
                self._busy += ended - began
                self._nbytes += nbytes
                self._received += received
                self._end = ended if nbytes else self._end
                if last:
                    self._next, self._taken = self._next + 1, 0
                self._cond.notify_all()

    def _reduce(self, groups: list[list[tuple[Tensor, int | None]]]) -> tuple[int, int]:
        """Every bucket summed; returns the bytes contributed and the bytes of sums received."""
        nbytes = received = 0
        for group in groups:
            owner = group[0][1]
            flat = torch.cat([t.detach().reshape(-1) for t, _ in group])
            total = self._all_reduce(flat) if owner is None else self._reduce_to(flat, owner)
            nbytes += _nbytes(flat)
            if total is None:  # another replica owns this bucket
                continue
            received += _nbytes(flat)
            offset = 0
            for tensor, _ in group:
                tensor.detach().copy_(total[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        return nbytes, received


@dataclass(frozen=True)
class DPContext:
    """What a stage worker needs to reduce its gradients over its DP group."""

    reducer: GradReducer
    overlap: bool = True  # False: reduce everything once every stage of every replica has run its last op
    zero_sum: AllReduce | None = None  # ZeRO-1: the group's sum, for the parameters each replica stepped

    def release(self, *, action: Action, weight_ops_left: dict[int, int]) -> GradSink | None:
        """Where `action` hands its chunk's gradients as they become final: the reduction, when it
        is the chunk's last weight-gradient op (counted down in `weight_ops_left`) and the
        reduction overlaps the other ops; else None."""
        if not self.overlap or not completes_weights(action):
            return None
        weight_ops_left[action.chunk] -= 1
        return None if weight_ops_left[action.chunk] else self.reducer.sink(key=action.chunk)


def owners(sizes: Sequence[int], *, replicas: int) -> list[int]:
    """ZeRO-1: the replica that holds the optimizer state of, and steps, each parameter (of these
    element counts): the biggest first, each to the least loaded replica so far (whole tensors, so
    a stage of one big tensor cannot be balanced); every replica computes the same."""
    loads = [0] * replicas
    chosen = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        replica = min(range(replicas), key=lambda d: (loads[d], d))
        chosen[index] = replica
        loads[replica] += sizes[index]
    return chosen


@torch.no_grad()
def gather_owned(
    tensors: Sequence[Tensor], *, owner: Sequence[int], rank: int, all_reduce: AllReduce, bucket_bytes: int
) -> int:
    """ZeRO-1's all-gather: every replica's `tensors` set to their owners' values, as a sum over the
    group in which each entry is nonzero on its owner alone (exact: x + 0 = x). Returns the bytes summed."""
    nbytes = 0
    mine = {id(t) for t, o in zip(tensors, owner, strict=True) if o == rank}
    for group in buckets(tensors, bucket_bytes=bucket_bytes):
        flat = torch.cat([t.reshape(-1) if id(t) in mine else torch.zeros_like(t).reshape(-1) for t in group])
        total = all_reduce(flat)
        offset = 0
        for tensor in group:
            tensor.copy_(total[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        nbytes += flat.numel() * flat.element_size()
    return nbytes


@dataclass(frozen=True)
class DPSpec:
    """Data parallelism as a fabric builds it: `size` replicas, buckets of `bucket_mb` MB, overlap or
    not, the optimizer state sharded over the replicas (`zero`: ZeRO-1) or not."""

    size: int
    bucket_mb: float = 25.0
    overlap: bool = True
    zero: bool = False

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"data parallelism needs size >= 2 replicas, got {self.size}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb:g}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))
