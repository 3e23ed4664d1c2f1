"""A chunk's gradients handed to data parallelism's reduction as they become final during its
last weight-gradient op, rather than after it: a post-accumulate hook on each parameter (the
weight passes and the full backward accumulate through autograd, so the hooks fire there) marks it
final, and each time the longest run of final parameters at the head of the fixed order goes out.
The order is the chunk's parameters last first, about the order a backward finalizes them; a
parameter that finalizes out of order holds the ones after it back, never reorders them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

from torch import nn


class GradRelease:
    """While entered, hands `release` each run of `params` (in order) that has become final; on a
    clean exit, the rest (parameters no gradient reached included: the receiver skips them)."""

    def __init__(self, *, params: Sequence[nn.Parameter], release: Callable[[list[nn.Parameter]], None]) -> None:
        self._order = list(params)
        self._release = release
        self._final: set[int] = set()
        self._next = 0
        self._handles: list = []

    def __enter__(self) -> Self:
        self._handles = [p.register_post_accumulate_grad_hook(self._on_final) for p in self._order]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if kind is None:
            self._final.update(map(id, self._order))
            self._emit()

    def _on_final(self, param: nn.Parameter) -> None:
        self._final.add(id(param))
        self._emit()

    def _emit(self) -> None:
        start = self._next
        while self._next < len(self._order) and id(self._order[self._next]) in self._final:
            self._next += 1
        if self._next > start:
            self._release(self._order[start : self._next])
