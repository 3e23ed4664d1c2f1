"""A plan: what one iteration runs, as plain data (like a schedule).

``packing`` (optional) places the samples of the global batch into microbatches
(`rrfp_ray.plan.packing`; None: the data's own microbatches); ``order[slot]`` is the data
microbatch that runs in that slot (slot i runs data microbatch order[i], with its durations,
features and bytes); ``hint`` is any policy name we have
(a fixed schedule, a ``ready-*`` list, a rule), which the plan picks but never bends;
``cap`` is the in-flight cap, as a multiple of the hint's own reference list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy, make_policy


@dataclass(frozen=True)
class Plan:
    order: tuple[int, ...]
    hint: str
    cap: Cap
    packing: Packing | None = None

    @classmethod
    def identity(cls, *, microbatches: int, hint: str, cap: Cap) -> Plan:
        return cls(order=tuple(range(microbatches)), hint=hint, cap=cap)

    def validate(self, *, stages: int, chunks: int, microbatches: int) -> Policy:
        """The hint's policy for this pipeline, or ValueError naming what does not fit."""
        if sorted(self.order) != list(range(microbatches)):
            raise ValueError(f"plan order {list(self.order)} is not a permutation of the {microbatches} microbatches")
        if self.packing is not None:
            placed = sorted(i for group in self.packing for i in group)
            if len(self.packing) != microbatches or placed != list(range(len(placed))) or not all(self.packing):
                raise ValueError(f"plan packing must place every sample once in {microbatches} non-empty microbatches")
        return policy_for(name=self.hint, stages=stages, chunks=chunks, microbatches=microbatches)

    def to_dict(self) -> dict[str, Any]:
        packing = None if self.packing is None else [list(group) for group in self.packing]
        return {"order": list(self.order), "hint": self.hint, "cap": str(self.cap), "packing": packing}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        packing = data.get("packing")
        return cls(
            order=tuple(int(j) for j in data["order"]),
            hint=str(data["hint"]),
            cap=Cap.parse(data["cap"]),
            packing=None if packing is None else tuple(tuple(int(i) for i in group) for group in packing),
        )


@lru_cache(maxsize=256)
def policy_for(*, name: str, stages: int, chunks: int, microbatches: int) -> Policy:
    """`make_policy`, built once per shape (policies are immutable plain data)."""
    return make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
