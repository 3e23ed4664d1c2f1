"""Collectives among threads of one process: what the in-process fabric (`rrfp_ray.runtime.local`)
gives its stages in place of gloo groups."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from torch import Tensor

T = TypeVar("T")


class ThreadAllReduce:
    """Sum of one float from each of `parties` threads, returned to all of them."""

    def __init__(self, *, parties: int, timeout_s: float) -> None:
        self._barrier = threading.Barrier(parties, timeout=timeout_s)
        self._lock = threading.Lock()
        self._total = 0.0

    def __call__(self, value: float) -> float:
        with self._lock:
            self._total += value
        self._barrier.wait()
        total = self._total
        if self._barrier.wait() == 0:
            self._total = 0.0
        self._barrier.wait()
        return total


class ThreadAllGather:
    """All-gather among `parties` threads: `member(rank)` is rank's callable; each call returns every rank's value, in
    rank order.

    A call that waits past `timeout_s` is a TimeoutError naming the group (`name`) and the members
    it waited for (`labels`, by rank)."""

    def __init__(
        self, *, parties: int, timeout_s: float, name: str = "all-gather", labels: Sequence[str] | None = None
    ) -> None:
        if parties < 1:
            raise ValueError(f"parties must be >= 1, got {parties}")
        self.parties = parties
        self.name = name
        self.labels = list(labels) if labels is not None else [f"rank {r}" for r in range(parties)]
        if len(self.labels) != parties:
            raise ValueError(f"labels: need one per party ({parties}), got {len(self.labels)}")
        self._timeout_s = timeout_s
        self._barrier = threading.Barrier(parties, timeout=timeout_s)
        self._values: list[Any] = [None] * parties
        self._lock = threading.Lock()
        self._arrived: set[int] = set()  # the ranks in the current round

    def member(self, rank: int) -> Callable[[T], list[T]]:
        if not 0 <= rank < self.parties:
            raise ValueError(f"rank must be in [0, {self.parties}), got {rank}")
        return functools.partial(self._gather, rank=rank)

    def _gather(self, value: T, *, rank: int) -> list[T]:
        with self._lock:
            self._values[rank] = value
            self._arrived.add(rank)
        try:
            self._barrier.wait()
            gathered = list(self._values)
            self._barrier.wait()  # nobody overwrites a slot before every rank has read it
        except threading.BrokenBarrierError:
            with self._lock:
                missing = [self.labels[r] for r in range(self.parties) if r not in self._arrived]
            waited = f"waited {self._timeout_s:g} s for {', '.join(missing)}" if missing else "found it broken"
            raise TimeoutError(f"{self.name}: {self.labels[rank]} {waited}") from None
        with self._lock:
            self._arrived.discard(rank)
        return gathered


def tensor_all_reduce(all_gather: Callable[[Tensor], list[Tensor]]) -> Callable[[Tensor], Tensor]:
    """Sum of a tensor over a group, added in rank order (the same bits on every rank)."""

    def all_reduce(tensor: Tensor) -> Tensor:
        return _rank_order_sum(all_gather(tensor))

    return all_reduce


def tensor_reduce_to(
    all_gather: Callable[[Tensor], list[Tensor]], *, rank: int
) -> Callable[[Tensor, int], Tensor | None]:
    """Sum of a tensor over a group at rank `dst` alone (the bits `tensor_all_reduce` gives), as rank `rank` calls
    it."""

    def reduce_to(tensor: Tensor, dst: int) -> Tensor | None:
        parts = all_gather(tensor)
        return _rank_order_sum(parts) if rank == dst else None

    return reduce_to


def _rank_order_sum(parts: list[Tensor]) -> Tensor:
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total
