"""A policy as plain data (`Policy`), built once from its name (`make_policy`) and sent to every
stage; `rrfp_ray.policy.pickers` turns it into each stage's picker."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.generators import SCHEDULES, build, lookup
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.validate import Hint


class Rule(enum.Enum):
    """Policies that pick by rule over the ready set, not by a list."""

    BF = "bf"
    BFW = "bfw"
    CPW = "cpw"

    @property
    def split(self) -> bool:
        return self is not Rule.BF


@dataclass(frozen=True)
class Policy:
    name: str
    order: dict[int, list[Action]] = field(repr=False)  # the hint list per stage (the reference list for rules)
    fixed: bool
    rule: Rule | None  # None for list policies
    split: bool
    placement: Placement = Placement.LOOPED

    def layout_over(self, pipeline: Layout) -> Layout:
        """The pipeline's layout with this policy's B/W split; its placement must be the pipeline's."""
        if self.placement is not pipeline.placement:
            raise ValueError(
                f"policy {self.name!r} runs on the {self.placement.value} placement, the pipeline was built "
                f"{pipeline.placement.value}: run policies of one placement on one pipeline"
            )
        return replace(pipeline, split=self.split)


def policy_names() -> list[str]:
    return [*SCHEDULES, *(f"ready-{name}" for name in SCHEDULES), *(r.value for r in Rule), "hint", "ready-hint"]


def describe_policies() -> str:
    """The policy names in one line, as help texts give them."""
    rules = ", ".join(r.value for r in Rule)
    return f"fixed: {', '.join(SCHEDULES)}; readiness: ready-<schedule>, {rules}; a user order: hint, ready-hint"


def make_policy(*, name: str, stages: int, chunks: int, microbatches: int, hint: Hint | None = None) -> Policy:
    """Resolve a CLI policy name; `hint` is the user's order for `hint` / `ready-hint`."""
    base = name.removeprefix("ready-")
    if base == "hint":
        if hint is None:
            raise ValueError(f"policy {name!r} needs a hint order (--hint FILE)")
        split = any(a.kind is Kind.W for actions in hint.order.values() for a in actions)
        return Policy(name=name, order=hint.order, fixed=base == name, rule=None, split=split, placement=hint.placement)
    if name in {r.value for r in Rule}:
        rule = Rule(name)
        reference = ("zb-h1" if rule.split else "1f1b") if chunks == 1 else "interleaved"
        order = build(name=reference, stages=stages, chunks=chunks, microbatches=microbatches)
        return Policy(name=name, order=order, fixed=False, rule=rule, split=rule.split)
    if base not in SCHEDULES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(policy_names())}")
    schedule = lookup(base)
    order = build(name=base, stages=stages, chunks=chunks, microbatches=microbatches)
    return Policy(
        name=name, order=order, fixed=base == name, rule=None, split=schedule.splits, placement=schedule.placement
    )
