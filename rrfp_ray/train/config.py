"""The typed config tree. Every bad value is a pydantic ValidationError (a ValueError)
naming its field, raised before any actor starts."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rrfp_ray.plan.planner import Arrangement, default_hints
from rrfp_ray.policy.agreement import TPGather, TPProtocol
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.policy import Policy, describe_policies, make_policy
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.validate import Hint, parse_order
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import SCENARIOS, generate
from rrfp_ray.train.precision import Precision

_STRICT = ConfigDict(extra="forbid", frozen=True)
PLANNED = "planned"  # not a picker policy: the Trainer asks rrfp_ray.plan for each iteration's plan


class ShapeConfig(BaseModel):
    """How the pipeline is cut: P stages of v chunks, M microbatches an iteration."""

    model_config = _STRICT

    stages: int = Field(4, ge=1, description="P: pipeline stages (one actor each)")
    chunks: int = Field(1, ge=1, description="v: model chunks per stage (v > 1: interleaved)")
    microbatches: int = Field(8, ge=1, description="M: microbatches per iteration")
    layer_split: tuple[int, ...] | None = Field(
        None,
        description="layers per virtual stage in forward order, e.g. 2,2,1,1 (stages x chunks numbers); "
        "default: even, the larger parts first",
    )

    @field_validator("layer_split", mode="before")
    @classmethod
    def _split_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return tuple(int(part) for part in value.split(","))
            except ValueError:
                raise ValueError(
                    f"layer_split must be comma-separated layer counts like 2,2,1,1, got {value!r}"
                ) from None
        return value

    @field_validator("layer_split", mode="after")
    @classmethod
    def _split_fits(cls, value: tuple[int, ...] | None, info: ValidationInfo) -> tuple[int, ...] | None:
        parts = info.data.get("stages", 1) * info.data.get("chunks", 1)
        if value is not None and (len(value) != parts or min(value) < 1):
            raise ValueError(
                f"{','.join(map(str, value))} must give each of the stages x chunks = {parts} virtual stages "
                "at least one layer"
            )
        return value


class ScheduleConfig(BaseModel):
    """What each stage runs next: the policy, its hint order and the in-flight cap."""

    model_config = _STRICT

    policy: str = Field(
        "bf", description=f"{describe_policies()}; {PLANNED}: each iteration's hint and microbatch order planned"
    )
    cap: Cap = Field(
        Cap(multiple=2.0),
        description="in-flight microbatches per stage: '1x'/'2x' of the hint's own peak, a count, or 'inf'",
    )
    arrange: Arrangement = Field(
        Arrangement.ORDER,
        description=(
            f"{PLANNED}: what each plan arranges: order (the microbatches' order), packing (the samples packed into "
            "microbatches of balanced cost; needs a data source that shows its samples and a (sum, count) loss, "
            "dp 1) or both"
        ),
    )
    hint: dict[int, list[str]] | None = Field(
        None,
        description="user hint order per stage (action texts, JSON or torch CSV cells), for policies hint/ready-hint",
    )

    @field_validator("cap", mode="plain")
    @classmethod
    def _cap(cls, value: Any) -> Cap:
        if isinstance(value, Cap):
            return value
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return Cap.parse(str(value))
        raise ValueError(f"cap must be a Cap or text like '2x', '6' or 'inf', got {value!r}")


class TransportConfig(BaseModel):
    """What carries the activations and gradients between stages."""

    model_config = _STRICT

    backend: LinkTransport = Field(
        LinkTransport.AUTO,
        description="what carries the links: auto (nccl with CUDA and cupy, else tcp), tcp, gloo or nccl",
    )
    buffer_limit: int = Field(32, ge=1, description="messages a stage holds received but not yet consumed")


class ParallelConfig(BaseModel):
    """Tensor and data parallelism around the pipeline."""

    model_config = _STRICT

    tp: int = Field(1, ge=1, description="T: tensor-parallel ranks (actors) per stage")
    tp_protocol: TPProtocol = Field(
        TPProtocol.COMMON,
        description="TP agreement: all-gather each rank's first choice, or its k best and run the best common one",
    )
    tp_gather: TPGather = Field(
        TPGather.TCP, description="what carries the TP agreement's all-gather: tcp or collective"
    )
    dp: int = Field(1, ge=1, description="D: data-parallel replicas of the whole pipeline (D x P x T actors)")
    dp_bucket_mb: float = Field(25.0, gt=0, description="MB of gradients per DP all-reduce bucket")
    dp_overlap: bool = Field(
        True,
        description="reduce a chunk's gradients as soon as its last weight-gradient op is done, "
        "not after every stage's last op",
    )
    zero: int = Field(
        0, ge=0, le=1, description="ZeRO stage: 1 shards the optimizer state over the D replicas (needs dp >= 2)"
    )


class FaultConfig(BaseModel):
    """How long a wait may last before it is a failure that names what it waited for."""

    model_config = _STRICT

    timeout_s: float = Field(60.0, gt=0, description="longest wait for any message, op or actor before an error")
    link_timeout_s: float = Field(1800.0, gt=0, description="longest a link may stay silent, between iterations too")


class ComputeConfig(BaseModel):
    """How each stage computes: number format and what it keeps for the backward."""

    model_config = _STRICT

    precision: Precision = Field(
        Precision.FP32,
        description="fp32, or bf16: autocast compute, fp32 master weights, bf16 activations on the links",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's internals in its backward instead of keeping them"
    )


class BalanceConfig(BaseModel):
    """Measuring each layer's cost, moving layers off a persistently slow stage, and resizing."""

    model_config = _STRICT

    measure_every: int | None = Field(
        None,
        ge=1,
        description="measure each stage's per-layer costs every N iterations (default: 10 with rebalance, else never)",
    )
    rebalance: bool = Field(False, description="move layers off a stage that stays slow (needs measured costs)")
    rebalance_threshold: float = Field(
        0.1, gt=0, description="a stage whose work is above the mean by this fraction is a bottleneck"
    )
    rebalance_window: int = Field(
        10,
        ge=1,
        description="measured iterations a bottleneck must last before a move (so at least between two moves), "
        "and iterations of gain a move must pay for",
    )
    stage_memory_mb: float | None = Field(
        None, gt=0, description="each stage's memory for the rebalancer's splits (default: the device's)"
    )
    resize_after: float | None = Field(
        None, gt=0, description="seconds to wait for a lost node's replacement before the job shrinks (default: never)"
    )

    @property
    def measure_period(self) -> int:
        """Iterations between measurements; 0: never."""
        if self.measure_every is not None:
            return self.measure_every
        return 10 if self.rebalance else 0


class PipelineConfig(BaseModel):
    """The pipeline in sections (shape, schedule, transport, parallel, faults, compute, balance). Flat
    keywords are accepted and read back as well: `PipelineConfig(stages=8, policy="bfw").stages`
    is `config.shape.stages`. Text given for `cap`, `backend` and `tp_protocol` is parsed here,
    once; the fields hold a `Cap`, a `LinkTransport` and a `TPProtocol`."""

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

    def __getattr__(self, name: str) -> Any:
        section = SECTION_OF.get(name)
        if section is None:
            return super().__getattr__(name)
        return getattr(getattr(self, section), name)

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
    model_config = _STRICT

    scenario: str = Field("none", description=f"'+'-joined names from {', '.join(SCENARIOS)}")
    seed: int = Field(0, ge=0, description="seed of the generated trace")
    t_f: float = Field(20.0, gt=0, description="forward time per virtual stage in ms (synthetic workload)")
    params: dict[str, float] = Field(default_factory=dict, description="scenario parameters, e.g. {'sigma': 0.3}")
    trace_file: str | None = Field(None, description="load this trace JSON instead of generating one")
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
        if self.trace_file is not None:
            trace = Trace.load(self.trace_file)
            trace.check(stages=pipeline.stages, microbatches=pipeline.microbatches, chunks=pipeline.chunks)
            return trace
        return generate(
            scenario=self.scenario,
            stages=pipeline.stages,
            microbatches=pipeline.microbatches,
            chunks=pipeline.chunks,
            seed=self.seed,
            t_f=self.t_f,
            **self.params,
        )
