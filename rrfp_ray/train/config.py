"""The typed config tree. Every bad value is a pydantic ValidationError (a ValueError)
naming its field, raised before any actor starts."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rrfp_ray.plan.planner import Arrangement, default_hints
from rrfp_ray.policy.agreement import TPGather, TPProtocol
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import Policy, make_policy
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.validate import Hint, parse_order
from rrfp_ray.sim.trace import Trace, load_iterations
from rrfp_ray.sim.variability import SCENARIOS, generate, generate_iterations
from rrfp_ray.train.precision import Precision
from rrfp_ray.train.sections import (
    PLANNED,
    STRICT,
    BalanceConfig,
    ComputeConfig,
    FaultConfig,
    ParallelConfig,
    ScheduleConfig,
    ShapeConfig,
    TransportConfig,
)


class PipelineConfig(BaseModel):
    """The pipeline in sections (shape, schedule, transport, parallel, faults, compute, balance). Flat
    keywords are accepted and read back as well, each through a property of its own:
    `PipelineConfig(stages=8, policy="bfw").stages` is `config.shape.stages`. Text given for `cap`,
    `backend` and `tp_protocol` is parsed here, once; the fields hold a `Cap`, a `LinkTransport` and a
    `TPProtocol`."""

    model_config = ConfigDict(extra="forbid", frozen=True, ignored_types=(cached_property,))

    shape: ShapeConfig = Field(default_factory=ShapeConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)

    @model_validator(mode="before")
    @classmethod
    def _flat_into_sections(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(name in SECTION_OF for name in data):
            return data
        nested = {name: value for name, value in data.items() if name not in SECTION_OF}
        for name, value in data.items():
            if name in SECTION_OF:
                section = SECTION_OF[name]
                given = nested.get(section, {})
                if isinstance(given, BaseModel):
                    given = {field: getattr(given, field) for field in type(given).model_fields}
                nested[section] = {**given, name: value}
        return nested

    # shape
    @property
    def stages(self) -> int:
        return self.shape.stages

    @property
    def chunks(self) -> int:
        return self.shape.chunks

    @property
    def microbatches(self) -> int:
        return self.shape.microbatches

    @property
    def layer_split(self) -> tuple[int, ...] | None:
        return self.shape.layer_split

    # schedule
    @property
    def policy(self) -> str:
        return self.schedule.policy

    @property
    def cap(self) -> Cap:
        return self.schedule.cap

    @property
    def arrange(self) -> Arrangement:
        return self.schedule.arrange

    @property
    def hint(self) -> dict[int, list[str]] | None:
        return self.schedule.hint

    @property
    def plan_simulations(self) -> int:
        return self.schedule.plan_simulations

    @property
    def plan_samples(self) -> int:
        return self.schedule.plan_samples

    # transport
    @property
    def backend(self) -> LinkTransport:
        return self.transport.backend

    @property
    def buffer_limit(self) -> int:
        return self.transport.buffer_limit

    # parallel
    @property
    def tp(self) -> int:
        return self.parallel.tp

    @property
    def tp_protocol(self) -> TPProtocol:
        return self.parallel.tp_protocol

    @property
    def tp_gather(self) -> TPGather:
        return self.parallel.tp_gather

    @property
    def dp(self) -> int:
        return self.parallel.dp

    @property
    def dp_bucket_mb(self) -> float:
        return self.parallel.dp_bucket_mb

    @property
    def dp_overlap(self) -> bool:
        return self.parallel.dp_overlap

    @property
    def zero(self) -> int:
        return self.parallel.zero

    # faults
    @property
    def timeout_s(self) -> float:
        return self.faults.timeout_s

    @property
    def link_timeout_s(self) -> float:
        return self.faults.link_timeout_s

    # compute
    @property
    def precision(self) -> Precision:
        return self.compute.precision

    @property
    def activation_checkpointing(self) -> bool:
        return self.compute.activation_checkpointing

    # balance
    @property
    def measure_every(self) -> int | None:
        return self.balance.measure_every

    @property
    def rebalance(self) -> bool:
        return self.balance.rebalance

    @property
    def rebalance_threshold(self) -> float:
        return self.balance.rebalance_threshold

    @property
    def rebalance_window(self) -> int:
        return self.balance.rebalance_window

    @property
    def stage_memory_mb(self) -> float | None:
        return self.balance.stage_memory_mb

    @property
    def resize_after(self) -> float | None:
        return self.balance.resize_after

    def replaced(self, **changes: Any) -> PipelineConfig:
        """A copy with `changes` (flat field names or sections), checked again."""
        return PipelineConfig(**{name: getattr(self, name) for name in type(self).model_fields}, **changes)

    @model_validator(mode="after")
    def _policy_fits(self) -> PipelineConfig:
        if self.zero and self.dp == 1:
            raise ValueError(
                f"zero {self.zero} shards the optimizer state over the DP replicas: it needs dp >= 2, got dp 1"
            )
        if self.stages == 1 and self.chunks > 1:
            raise ValueError("chunks > 1 needs stages >= 2 (a stage cannot send to itself)")
        if self.policy == PLANNED and self.arrange.packs and self.dp != 1:
            raise ValueError(
                f"arrange {self.arrange.value} packs the samples of one replica: it needs dp 1, got {self.dp}"
            )
        if self.rebalance and self.chunks > 1:
            raise ValueError(
                f"rebalance moves layers between stages of one chunk each: it needs chunks 1, got chunks {self.chunks}"
            )
        try:
            self._layout_policy()
        except ValueError as error:
            raise ValueError(f"policy {self.policy!r}: {error}") from None
        return self

    @property
    def actors(self) -> int:
        """D x P x T: one actor (or thread) per (replica, stage, TP rank)."""
        return self.dp * self.stages * self.tp

    @property
    def dp_spec(self) -> DPSpec | None:
        """Data parallelism as the fabrics build it (None without: dp = 1)."""
        if self.dp == 1:
            return None
        return DPSpec(size=self.dp, bucket_mb=self.dp_bucket_mb, overlap=self.dp_overlap, zero=bool(self.zero))

    @property
    def global_microbatches(self) -> int:
        """D x M: the microbatches of an iteration over every replica (what the data source holds)."""
        return self.dp * self.microbatches

    @cached_property
    def layout(self) -> Layout:
        policy = self._layout_policy()
        return Layout(
            stages=self.stages,
            chunks=self.chunks,
            microbatches=self.microbatches,
            split=policy.split,
            placement=policy.placement,
        )

    @cached_property
    def parsed_hint(self) -> Hint | None:
        """The hint order checked against the shape, parsed once."""
        if self.hint is None:
            return None
        return parse_order(self.hint, stages=self.stages, chunks=self.chunks, microbatches=self.microbatches)

    def resolved_policy(self, name: str) -> Policy:
        """The policy `name`, one for every iteration; `planned` has none (the Trainer plans each iteration)."""
        if name == PLANNED:
            raise ValueError(
                f"policy {PLANNED!r} is planned per iteration by the Trainer (Trainer.step); "
                "this run takes one policy for every iteration"
            )
        return make_policy(
            name=name, stages=self.stages, chunks=self.chunks, microbatches=self.microbatches, hint=self.parsed_hint
        )

    def _layout_policy(self) -> Policy:
        """The policy the pipeline is built for: `planned`'s first hint, whose layout its plans share."""
        name = default_hints(chunks=self.chunks)[0] if self.policy == PLANNED else self.policy
        return self.resolved_policy(name)


SECTION_OF = {  # a flat field name -> the PipelineConfig section that holds it
    name: section
    for section, info in PipelineConfig.model_fields.items()
    for name in info.annotation.model_fields  # type: ignore[union-attr]
}


class VariabilityConfig(BaseModel):
    model_config = STRICT

    scenario: str = Field("none", description=f"'+'-joined names from {', '.join(SCENARIOS)}")
    seed: int = Field(0, ge=0, description="seed of the generated trace")
    t_f: float = Field(20.0, gt=0, description="forward time per virtual stage in ms (synthetic workload)")
    params: dict[str, float] = Field(default_factory=dict, description="scenario parameters, e.g. {'sigma': 0.3}")
    trace_file: str | None = Field(
        None,
        description='load this trace JSON (one iteration, or {"iterations": [...]} replayed in turn) instead of '
        "generating one",
    )
    slow_devices: dict[int, float] = Field(
        default_factory=dict,
        description="stage:factor pairs, comma-separated, e.g. 2:1.5: that stage's device computes factor (>= 1) "
        "times slower, whatever layers it holds",
    )

    @field_validator("slow_devices", mode="before")
    @classmethod
    def _slow_text(cls, value: Any) -> Any:
        if value is None:  # the flag not given
            return {}
        if not isinstance(value, str):
            return value
        pairs = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            stage, colon, factor = part.partition(":")
            try:
                pairs[int(stage)] = float(factor)
            except ValueError:
                colon = ""
            if not colon:
                raise ValueError(f"slow_devices must be stage:factor pairs like 2:1.5, got {part!r}")
        return pairs

    @field_validator("slow_devices")
    @classmethod
    def _slow_values(cls, value: dict[int, float]) -> dict[int, float]:
        for stage, factor in value.items():
            if stage < 0 or not factor >= 1.0 or factor == float("inf"):
                raise ValueError(f"slow_devices {stage}:{factor:g}: a stage >= 0 and a finite factor >= 1")
        return value

    @model_validator(mode="after")
    def _scenario_known(self) -> VariabilityConfig:
        generate(
            scenario=self.scenario, stages=1, microbatches=1, chunks=1, seed=self.seed, t_f=self.t_f, **self.params
        )
        return self

    def check_slow_devices(self, *, stages: int) -> None:
        """ValueError unless every slow device is one of the pipeline's `stages`."""
        outside = sorted(stage for stage in self.slow_devices if stage >= stages)
        if outside:
            raise ValueError(f"variability.slow_devices: stages {outside} are not among the pipeline's {stages} stages")

    def trace(self, *, pipeline: PipelineConfig) -> Trace:
        """The first iteration of `traces`."""
        return self.traces(pipeline=pipeline)[0]

    def traces(self, *, pipeline: PipelineConfig, iterations: int = 1) -> tuple[Trace, ...]:
        """A trace file's iterations (either form), else `iterations` iterations of one seeded run of the scenario."""
        shape = {"stages": pipeline.stages, "microbatches": pipeline.microbatches, "chunks": pipeline.chunks}
        if self.trace_file is not None:
            traces = load_iterations(self.trace_file)
            for trace in traces:
                trace.check(**shape)
            return traces
        return generate_iterations(
            iterations=iterations, scenario=self.scenario, seed=self.seed, t_f=self.t_f, **shape, **self.params
        )
