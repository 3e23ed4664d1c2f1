"""Mixed precision on CPU: bf16 autocast over fp32 master weights, bf16 on the links; the loss
stays within a stated tolerance of fp32's over 30 iterations."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.config import PipelineConfig

TOLERANCE = 0.01  # relative, per iteration, bf16 against fp32 (measured: 0.0002)


def _run(precision: str) -> RunConfig:
    return RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 32},
        pipeline={"stages": 2, "microbatches": 4, "policy": "bfw", "timeout_s": 60, "precision": precision},
        train={"micro_batch_size": 4, "seq_len": 32, "iterations": 30, "warmup": 2},
    )


def test_bf16_trains_within_tolerance_of_fp32_with_fp32_weights_and_bf16_messages():
    losses = {}
    for precision in ("fp32", "bf16"):
        with gpt_trainer(_run(precision)) as trainer:
            losses[precision] = [trainer.step().loss for _ in range(30)]
            executor = trainer.backend.executors[0]
            inputs, _ = trainer.workload.data.microbatch(iteration=0, index=0)
            sent = executor.runner.forward(chunk=0, microbatch=99, inputs=inputs)
            params = executor.runner.parameters()
            state = [t for s in executor.runner._optimizer.state.values() for t in s.values() if t.dim() > 0]
            if precision == "bf16":
                assert sent.dtype == torch.bfloat16  # half the bytes on the link, and the header says so
            assert all(p.dtype == torch.float32 for p in params) and all(t.dtype == torch.float32 for t in state)
    fp32, bf16 = losses["fp32"], losses["bf16"]
    assert bf16[-1] < bf16[0] * 0.8
    worst = max(abs(a - b) / a for a, b in zip(fp32, bf16))
    print(f"bf16 vs fp32 over 30 iterations: worst relative loss difference {worst:.4f}")
    assert worst < TOLERANCE
    assert bf16 != fp32


def test_precision_other_than_fp32_or_bf16_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="precision"):
        PipelineConfig(stages=2, precision="fp16")
