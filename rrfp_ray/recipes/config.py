"""The GPT recipe's run: its model, pipeline, variability and training settings (data, learning
rate, checkpoints), checked together. Every bad value is a pydantic ValidationError naming its field."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rrfp_ray.models.gpt import GPTConfig
from rrfp_ray.train.config import PipelineConfig, VariabilityConfig

_STRICT = ConfigDict(extra="forbid", frozen=True)


class TrainConfig(BaseModel):
    model_config = _STRICT

    iterations: int = Field(30, ge=1, description="optimizer steps")
    micro_batch_size: int = Field(8, ge=1, description="samples per microbatch")
    seq_len: int = Field(64, ge=1, description="tokens per sample; at most model.block_size")
    lr: float = Field(3e-3, gt=0, description="peak learning rate, after the warmup")
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
    layers: int | None = Field(
        None, ge=1, description="the model's layer count where the model is not the GPT (n_layer + 2)"
    )

    @model_validator(mode="after")
    def _fits(self) -> RunConfig:
        layers = self.model.n_layer + 2 if self.layers is None else self.layers
        counted = f" (n_layer={self.model.n_layer} blocks + embedding + head)" if self.layers is None else ""
        parts = self.pipeline.stages * self.pipeline.chunks
        if parts > layers:
            raise ValueError(
                f"pipeline.stages x pipeline.chunks = {parts} is more than the model's {layers} layers{counted}"
            )
        split = self.pipeline.layer_split
        if split is not None and sum(split) != layers:
            raise ValueError(
                f"pipeline.layer_split {','.join(map(str, split))} holds {sum(split)} layers; the model has "
                f"{layers}{counted}"
            )
        if self.pipeline.tp > 1:
            if self.model.n_head % self.pipeline.tp:
                raise ValueError(f"pipeline.tp {self.pipeline.tp} does not divide model.n_head {self.model.n_head}")
            if 4 * self.model.n_embd % self.pipeline.tp:
                raise ValueError(f"pipeline.tp {self.pipeline.tp} does not divide the MLP width 4 x model.n_embd")
        self.variability.check_slow_devices(stages=self.pipeline.stages)
        if self.pipeline.resize_after is not None and self.train.max_restarts < 1:
            raise ValueError(
                f"pipeline.resize_after {self.pipeline.resize_after:g} resizes when a lost stage's restart cannot be "
                "placed: it needs train.max_restarts >= 1 (and train.checkpoint_dir to resume from)"
            )
        if self.train.seq_len > self.model.block_size:
            raise ValueError(f"train.seq_len {self.train.seq_len} is over model.block_size {self.model.block_size}")
        return self
