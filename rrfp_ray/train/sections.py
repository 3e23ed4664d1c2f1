"""The sections of `PipelineConfig` (`rrfp_ray.train.config`): shape, schedule, transport, parallel,
faults, compute and balance, each a frozen model whose bad values name their field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rrfp_ray.plan.planner import Arrangement
from rrfp_ray.policy.agreement import TPGather, TPProtocol
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import describe_policies
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.train.precision import Precision

STRICT = ConfigDict(extra="forbid", frozen=True)
PLANNED = "planned"  # not a picker policy: the Trainer asks rrfp_ray.plan for each iteration's plan


class ShapeConfig(BaseModel):
    """How the pipeline is cut: P stages of v chunks, M microbatches an iteration."""

    model_config = STRICT

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

    model_config = STRICT

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
    plan_simulations: int = Field(
        32, ge=1, description=f"{PLANNED}: the search budget, simulated iterations per plan (at least plan_samples)"
    )
    plan_samples: int = Field(2, ge=1, description=f"{PLANNED}: noise samples each candidate plan is simulated over")

    @field_validator("cap", mode="plain")
    @classmethod
    def _cap(cls, value: Any) -> Cap:
        if isinstance(value, Cap):
            return value
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return Cap.parse(str(value))
        raise ValueError(f"cap must be a Cap or text like '2x', '6' or 'inf', got {value!r}")

    @field_validator("plan_samples")
    @classmethod
    def _samples_fit(cls, value: int, info: ValidationInfo) -> int:
        simulations = info.data.get("plan_simulations", value)
        if value > simulations:
            raise ValueError(f"plan_samples {value} must not exceed plan_simulations {simulations}")
        return value


class TransportConfig(BaseModel):
    """What carries the activations and gradients between stages."""

    model_config = STRICT

    backend: LinkTransport = Field(
        LinkTransport.AUTO,
        description="what carries the links: auto (nccl with CUDA and cupy, else tcp), tcp, gloo or nccl",
    )
    buffer_limit: int = Field(32, ge=1, description="messages a stage holds received but not yet consumed")


class ParallelConfig(BaseModel):
    """Tensor and data parallelism around the pipeline."""

    model_config = STRICT

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

    model_config = STRICT

    timeout_s: float = Field(60.0, gt=0, description="longest wait for any message, op or actor before an error")
    link_timeout_s: float = Field(1800.0, gt=0, description="longest a link may stay silent, between iterations too")


class ComputeConfig(BaseModel):
    """How each stage computes: number format and what it keeps for the backward."""

    model_config = STRICT

    precision: Precision = Field(
        Precision.FP32,
        description="fp32, or bf16: autocast compute, fp32 master weights, bf16 activations on the links",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's internals in its backward instead of keeping them"
    )


class BalanceConfig(BaseModel):
    """Measuring each layer's cost, moving layers off a persistently slow stage, and resizing."""

    model_config = STRICT

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
