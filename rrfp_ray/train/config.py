"""The typed config tree. Every bad value is a pydantic ValidationError (a ValueError)
naming its field, raised before any actor starts."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rrfp_ray.models.gpt import GPTConfig
from rrfp_ray.policy.agreement import TPGather, TPProtocol
from rrfp_ray.policy.arbiter import Cap
from rrfp_ray.policy.pickers import Policy, make_policy
from rrfp_ray.runtime.reduce import DPSpec
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.schedule.deps import Layout
from rrfp_ray.schedule.validate import parse_order
from rrfp_ray.sim.variability import SCENARIOS, Trace, generate
from rrfp_ray.train.precision import Precision

_STRICT = ConfigDict(extra="forbid", frozen=True)


class PipelineConfig(BaseModel):
    """Strings given for `cap`, `backend` and `tp_protocol` are parsed here, once; the fields
    hold a `Cap`, a `LinkTransport` and a `TPProtocol`."""

    model_config = _STRICT

    stages: int = Field(4, ge=1, description="P: pipeline stages (one actor each)")
    chunks: int = Field(1, ge=1, description="v: model chunks per stage (v > 1: interleaved)")
    microbatches: int = Field(8, ge=1, description="M: microbatches per iteration")
    policy: str = Field(
        "bf", description="fixed: gpipe, 1f1b, interleaved, zb-h1; readiness: ready-<schedule>, bf, bfw, cpw"
    )
    cap: Cap = Field(
        Cap(multiple=2.0),
        description="in-flight microbatches per stage: '1x'/'2x' of the hint's own peak, a count, or 'inf'",
    )
    buffer_limit: int = Field(32, ge=1, description="messages a stage holds received but not yet consumed")
    timeout_s: float = Field(60.0, gt=0, description="longest wait for any message, op or actor before an error")
    link_timeout_s: float = Field(1800.0, gt=0, description="longest a link may stay silent, between iterations too")
    backend: LinkTransport = Field(
        LinkTransport.AUTO,
        description="what carries the links: auto (nccl with CUDA and cupy, else tcp), tcp, gloo or nccl",
    )
    tp: int = Field(1, ge=1, description="T: tensor-parallel ranks (actors) per stage")
    tp_protocol: TPProtocol = Field(
        TPProtocol.COMMON,
        description="TP agreement: all-gather each rank's first choice, or its k best and run the best common one",
    )
    tp_gather: TPGather = Field(
        TPGather.TCP, description="what carries the TP agreement's all-gather: tcp or collective"
    )
    hint: dict[int, list[str]] | None = Field(
        None,
        description="user hint order per stage (action texts, JSON or torch CSV cells), for policies hint/ready-hint",
    )
    dp: int = Field(1, ge=1, description="D: data-parallel replicas of the whole pipeline (D x P x T actors)")
    dp_bucket_mb: float = Field(25.0, gt=0, description="MB of gradients per DP all-reduce bucket")
    dp_overlap: bool = Field(
        True,
        description="reduce a chunk's gradients as soon as its last weight-gradient op is done "
        "(False: everything after every stage's last op)",
    )
    zero: int = Field(
        0, ge=0, le=1, description="ZeRO stage: 1 shards the optimizer state over the D replicas (needs dp >= 2)"
    )
    precision: Precision = Field(
        Precision.FP32,
        description="fp32, or bf16: autocast compute, fp32 master weights, bf16 activations on the links",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each block's internals in its backward instead of keeping them"
    )

    @field_validator("cap", mode="plain")
    @classmethod
    def _cap(cls, value: Any) -> Cap:
        if isinstance(value, Cap):
            return value
        if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            return Cap.parse(str(value))
        raise ValueError(f"cap must be a Cap or text like '2x', '6' or 'inf', got {value!r}")

    @model_validator(mode="after")
    def _policy_fits(self) -> PipelineConfig:
        if self.zero and self.dp == 1:
            raise ValueError(
                f"zero {self.zero} shards the optimizer state over the DP replicas: it needs dp >= 2, got dp 1"
            )
        if self.stages == 1 and self.chunks > 1:
            raise ValueError("chunks > 1 needs stages >= 2 (a stage cannot send to itself)")
        try:
            self.resolved_policy(self.policy)
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

    @property
    def layout(self) -> Layout:
        policy = self.resolved_policy(self.policy)
        return Layout(
            stages=self.stages,
            chunks=self.chunks,
            microbatches=self.microbatches,
            split=policy.split,
            placement=policy.placement,
        )

    @property
    def parsed_cap(self) -> Cap:
        """Deprecated alias of `cap` (which now holds the parsed `Cap`); goes in the next release."""
        return self.cap

    def resolved_policy(self, name: str) -> Policy:
        hint = None
        if self.hint is not None:
            hint = parse_order(self.hint, stages=self.stages, chunks=self.chunks, microbatches=self.microbatches)
        return make_policy(name=name, stages=self.stages, chunks=self.chunks, microbatches=self.microbatches, hint=hint)


class VariabilityConfig(BaseModel):
    model_config = _STRICT

    scenario: str = Field("none", description=f"'+'-joined names from {', '.join(SCENARIOS)}")
    seed: int = Field(0, ge=0)
    t_f: float = Field(20.0, gt=0, description="forward time per virtual stage in ms (synthetic workload)")
    params: dict[str, float] = Field(default_factory=dict, description="scenario parameters, e.g. {'sigma': 0.3}")
    trace_file: str | None = Field(None, description="load this trace JSON instead of generating one")

    @model_validator(mode="after")
    def _scenario_known(self) -> VariabilityConfig:
        generate(
            scenario=self.scenario, stages=1, microbatches=1, chunks=1, seed=self.seed, t_f=self.t_f, **self.params
        )
        return self

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


class TrainConfig(BaseModel):
    model_config = _STRICT

    iterations: int = Field(30, ge=1)
    micro_batch_size: int = Field(8, ge=1)
    seq_len: int = Field(64, ge=1, description="tokens per sample; at most model.block_size")
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup: int = Field(5, ge=0, description="iterations of linear learning-rate warmup")
    weight_decay: float = Field(0.1, ge=0)
    max_grad_norm: float = Field(1.0, gt=0, description="global gradient-norm clip, over all stages")
    seed: int = Field(0, ge=0, description="model init and data order")
    data: str | None = Field(None, description="text file or directory; default: the Python stdlib's sources")
    val_every: int = Field(10, ge=0, description="validation loss every N iterations (0: never)")
    val_microbatches: int = Field(4, ge=1)
    device: Literal["cpu", "cuda"] = Field("cpu", description="where each stage computes")
    checkpoint_dir: str | None = Field(None, description="where checkpoints go (none: no checkpoints)")
    checkpoint_every: int = Field(10, ge=0, description="iterations between checkpoints (0: never)")
    resume: bool = Field(False, description="start from the newest complete checkpoint in checkpoint_dir")
    max_restarts: int = Field(0, ge=0, description="rebuilds from the last checkpoint after a stage is lost")
    varlen: bool = Field(
        False, description="whole documents of varying length, padding left out of a token-weighted loss"
    )

    @model_validator(mode="after")
    def _resume_needs_a_directory(self) -> TrainConfig:
        if (self.resume or self.max_restarts) and self.checkpoint_dir is None:
            raise ValueError("train.resume and train.max_restarts need train.checkpoint_dir")
        return self


class RunConfig(BaseModel):
    model_config = _STRICT

    model: GPTConfig = Field(default_factory=GPTConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    variability: VariabilityConfig = Field(default_factory=VariabilityConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)

    @model_validator(mode="after")
    def _fits(self) -> RunConfig:
        layers = self.model.n_layer + 2  # embedding, blocks, head
        parts = self.pipeline.stages * self.pipeline.chunks
        if parts > layers:
            raise ValueError(
                f"pipeline.stages x pipeline.chunks = {parts} is more than the model's {layers} layers "
                f"(n_layer={self.model.n_layer} blocks + embedding + head)"
            )
        if self.pipeline.tp > 1:
            if self.model.n_head % self.pipeline.tp:
                raise ValueError(f"pipeline.tp {self.pipeline.tp} does not divide model.n_head {self.model.n_head}")
            if 4 * self.model.n_embd % self.pipeline.tp:
                raise ValueError(f"pipeline.tp {self.pipeline.tp} does not divide the MLP width 4 x model.n_embd")
        if self.train.seq_len > self.model.block_size:
            raise ValueError(f"train.seq_len {self.train.seq_len} is over model.block_size {self.model.block_size}")
        return self
