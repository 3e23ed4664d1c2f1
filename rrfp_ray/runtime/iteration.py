"""What every stage is given for one iteration, as one value: the group builds it once and each
fabric carries it to its stages unchanged; a new per-iteration input joins it here."""

from __future__ import annotations

from dataclasses import dataclass

from rrfp_ray.plan.packing import Packing
from rrfp_ray.policy.agreement import TPProtocol
from rrfp_ray.policy.caps import Cap, Memory
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.layout import Layout


@dataclass(frozen=True)
class IterationArgs:
    iteration: int
    layout: Layout  # the pipeline's layout as the policy runs it (`Policy.layout_over`)
    policy: Policy
    cap: Cap
    buffer_limit: int | None = None  # most messages a stage's receive buffer holds (None: no limit)
    tp_protocol: TPProtocol = TPProtocol.FIRST  # how TP ranks agree (unused without TP)
    # the data microbatch each microbatch slot trains on (`order[slot]`); None: slot m trains on microbatch m
    order: tuple[int, ...] | None = None
    # per data microbatch of every replica (D x M), the samples of the global batch it holds; None: the data's own
    packing: Packing | None = None
    measure: bool = False  # each stage measures its layers' costs after this iteration (`StageStats.layer_costs`)
    # per stage, the activation bytes its arbiter gates admissions by (`rrfp_ray.sim.memory.DataBytes.memories`);
    # None: every microbatch weighs 1 (the cap counts microbatches)
    memory: tuple[Memory | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.memory is None:
            return
        if len(self.memory) != self.layout.stages:
            raise ValueError(f"memory: expected one per stage ({self.layout.stages}), got {len(self.memory)}")
        for stage, memory in enumerate(self.memory):
            if memory is not None and len(memory.held) != self.layout.microbatches:
                raise ValueError(
                    f"memory of stage {stage}: holds {len(memory.held)} microbatches, "
                    f"expected {self.layout.microbatches}"
                )


def measures(*, iteration: int, period: int) -> bool:
    """Whether iteration `iteration` measures its stages' layer costs, every `period` iterations (0: never)."""
    return period > 0 and iteration % period == 0
