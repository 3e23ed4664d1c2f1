"""When a stage's gradients are final, in which order and in which buckets data parallelism sums
them: one rule for the runtime's reduction (`rrfp_ray.runtime.reduce`) and the simulator's model
of it (`rrfp_ray.sim.reduction`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from rrfp_ray.schedule.actions import Action, Kind

T = TypeVar("T")


def completes_weights(action: Action) -> bool:
    """Whether `action` writes weight gradients: W, or the full backward B (never split)."""
    return action.kind in (Kind.W, Kind.B)


def reduce_order(*, chunks: int) -> list[int]:
    """The order every replica reduces a stage's chunks in: the last chunk's backward ends first."""
    return list(reversed(range(chunks)))


class Bucketer(Generic[T]):
    """Greedy buckets over a stream of gradients in their fixed order: each group's (owner's)
    items in runs of one kind (dtype) of at most `bucket_bytes` bytes, a bigger item alone.

    A bucket is handed back as soon as no later item can join it: once full, or once the next
    item of its group does not fit; `flush` (the stream's end) hands back the rest. The buckets
    and their order depend on the items alone, not on the parts the stream came in, so every
    replica sums the same buckets in the same order however its gradients were released."""

    def __init__(self, *, bucket_bytes: int) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self._limit = bucket_bytes
        self._open: dict[Hashable, tuple[Hashable, list[T], int]] = {}  # group: (kind, items, bytes)

    def add(self, item: T, *, nbytes: int, group: Hashable = None, kind: Hashable = None) -> list[list[T]]:
        """`item` appended; returns the buckets it closed (at most two: its group's last, and its own if full)."""
        closed = []
        current = self._open.pop(group, None)
        if current is not None and (current[0] != kind or current[2] + nbytes > self._limit):
            closed.append(current[1])
            current = None
        items, size = (current[1], current[2]) if current is not None else ([], 0)
        items.append(item)
        size += nbytes
        if size >= self._limit:
            closed.append(items)
        else:
            self._open[group] = (kind, items, size)
        return closed

    def flush(self) -> list[list[T]]:
        """The buckets still open, in the order of their groups' latest items; the bucketer is empty again."""
        rest = [items for _, items, _ in self._open.values()]
        self._open.clear()
        return rest


def even_split(total: int, *, parts: int) -> list[int]:
    """`total` as `parts` sizes, as equal as they can be, the bigger first."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    size, rest = divmod(total, parts)
    return [size + (1 if i < rest else 0) for i in range(parts)]
