"""A plan: what one iteration runs, as plain data (like a schedule).

``order[slot]`` is the data microbatch that runs in that slot (slot i runs data microbatch
order[i], with its durations, features and bytes); ``hint`` is any policy name we have
(a fixed schedule, a ``ready-*`` list, a rule), which the plan picks but never bends;
``cap`` is the in-flight cap, as a multiple of the hint's own reference list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy, make_policy


@dataclass(frozen=True)
class Plan:
    order: tuple[int, ...]
    hint: str
    cap: Cap

    @classmethod
    def identity(cls, *, microbatches: int, hint: str, cap: Cap) -> Plan:
        return cls(order=tuple(range(microbatches)), hint=hint, cap=cap)

    def validate(self, *, stages: int, chunks: int, microbatches: int) -> Policy:
        """The hint's policy for this pipeline, or ValueError naming what does not fit."""
        if sorted(self.order) != list(range(microbatches)):
            raise ValueError(f"plan order {list(self.order)} is not a permutation of the {microbatches} microbatches")
        return policy_for(name=self.hint, stages=stages, chunks=chunks, microbatches=microbatches)

    def to_dict(self) -> dict[str, Any]:
        return {"order": list(self.order), "hint": self.hint, "cap": str(self.cap)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        return cls(order=tuple(int(j) for j in data["order"]), hint=str(data["hint"]), cap=Cap.parse(data["cap"]))


@lru_cache(maxsize=256)
def policy_for(*, name: str, stages: int, chunks: int, microbatches: int) -> Policy:
    """`make_policy`, built once per shape (policies are immutable plain data)."""
    return make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
