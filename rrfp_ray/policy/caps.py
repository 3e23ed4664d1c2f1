"""The limits a stage's arbiter enforces: the in-flight cap (`Cap`) and, for microbatches of different
sizes, the activation bytes a stage may hold (`Memory`); `rrfp_ray.policy.arbiter` says how they gate."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_CAP = re.compile(r"^(?:(\d+(?:\.\d+)?)x|(\d+)|inf)$")


@dataclass(frozen=True)
class Cap:
    """An in-flight cap: a multiple of the hint schedule's own peak (`2x`), a count (`6`) or `inf`."""

    multiple: float | None = None
    count: int | None = None

    @classmethod
    def parse(cls, text: str) -> Cap:
        match = _CAP.match(text.strip().lower())
        if match is None:
            raise ValueError(f"cap must look like '1x', '2x', '1.5x', an integer >= 1 or 'inf', got {text!r}")
        multiple, count = match.groups()
        if multiple is not None:
            if float(multiple) <= 0:
                raise ValueError(f"cap multiple must be > 0, got {text!r}")
            return cls(multiple=float(multiple))
        if count is not None:
            if int(count) < 1:
                raise ValueError(f"cap must be >= 1 microbatch, got {text!r}")
            return cls(count=int(count))
        return cls()

    def limit(self, *, peak: int) -> float:
        if self.count is not None:
            return self.count
        if self.multiple is not None:
            return max(1, math.ceil(self.multiple * peak))
        return math.inf

    def __str__(self) -> str:
        if self.count is not None:
            return str(self.count)
        return "inf" if self.multiple is None else f"{self.multiple:g}x"


@dataclass(frozen=True)
class Memory:
    """One stage's activation memory in bytes: per microbatch, what it holds on the stage from its
    chunk-0 F on (all its chunks), and the F->B and F->W limits (inf: none)."""

    held: tuple[float, ...]
    limit_fb: float
    limit_fw: float = math.inf
