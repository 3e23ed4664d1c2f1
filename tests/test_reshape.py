"""Checkpoints keyed by parameter: a run resumed onto another pipeline shape (stages, TP, DP with and
without ZeRO-1, chunks, split) trains what the uninterrupted run trains; another model or the old
chunk-indexed format is refused naming why; `Trainer.reshape` moves a running pipeline to a new split."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import train_gpt
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer
from rrfp_ray.train.checkpoint import CheckpointError

MODEL = {"n_layer": 4, "n_embd": 32, "n_head": 4, "block_size": 16}  # 6 layers: embedding, 4 blocks, head
ITERATIONS = 6
EVEN = {"stages": 2, "microbatches": 4}


def _run(directory: Path | None = None, *, resume: bool = False, **pipeline: Any) -> RunConfig:
    train = {"micro_batch_size": 2, "seq_len": 16, "iterations": ITERATIONS, "warmup": 1}
    if directory is not None:
        train |= {"checkpoint_dir": str(directory), "checkpoint_every": 2, "resume": resume}
    return RunConfig(model=MODEL, pipeline={"policy": "1f1b", "timeout_s": 60, **pipeline}, train=train)


def _losses(run: RunConfig, *, iterations: int) -> list[float]:
    with gpt_trainer(run) as trainer:
        return [report.loss for report in trainer.fit(iterations - trainer.iteration)]


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The uninterrupted run's losses (every shape trains the same: tests/test_layer_split.py)."""
    return _losses(_run(**EVEN), iterations=ITERATIONS)


def _resumed(tmp_path: Path, shapes: list[dict[str, Any]]) -> list[float]:
    """Two iterations on each shape in turn, each resuming the last one's checkpoint."""
    losses: list[float] = []
    for n, shape in enumerate(shapes):
        losses += _losses(_run(tmp_path, resume=n > 0, **shape), iterations=2 * (n + 1))
    return losses


@pytest.mark.parametrize(
    "shapes",
    [
        [{"stages": 4, "microbatches": 4}, {"stages": 2, "microbatches": 4}, {"stages": 3, "microbatches": 4}],
        [{"stages": 2, "microbatches": 4, "tp": 2}, {"stages": 2, "microbatches": 4}, {**EVEN, "tp": 2}],
        [
            {"stages": 2, "dp": 2, "microbatches": 2},
            {"stages": 2, "microbatches": 4},
            {"stages": 3, "dp": 2, "microbatches": 2, "policy": "bfw"},
        ],
        [
            {"stages": 2, "dp": 2, "zero": 1, "microbatches": 2},
            {"stages": 2, "microbatches": 4},
            {"stages": 3, "dp": 2, "zero": 1, "microbatches": 2, "policy": "bfw"},
        ],
        [
            {"stages": 3, "microbatches": 4},
            {"stages": 2, "chunks": 2, "microbatches": 4, "policy": "bfw"},
            {"stages": 3, "microbatches": 4},
        ],
        [
            {"stages": 3, "layer_split": (1, 1, 4), "microbatches": 4},
            {"stages": 3, "layer_split": (4, 1, 1), "microbatches": 4},
            EVEN,
        ],
    ],
    ids=["P 4-2-3", "T 2-1-2", "D 2-1-2", "ZeRO D 2-1-2", "v 1-2-1", "split 114-411"],
)
def test_a_run_resumed_onto_other_shapes_trains_as_the_uninterrupted_run(tmp_path, reference, shapes):
    assert _resumed(tmp_path, shapes) == pytest.approx(reference, rel=1e-4)


def test_the_manifest_records_the_shape_and_which_file_holds_each_parameter(tmp_path):
    _losses(_run(tmp_path, stages=2, tp=2, microbatches=4), iterations=2)
    manifest = json.loads((tmp_path / "manifest-00000002.json").read_text())
    assert manifest["shape"] | {"layer_split": None} == {
        "stages": 2, "tp": 2, "dp": 1, "chunks": 1, "placement": "looped", "layer_split": None, "zero": 0,
        "microbatches": 4,
    }  # fmt: skip
    assert manifest["shape"]["layer_split"] == [3, 3]
    held = {name: [f["tp_rank"] for f in manifest["files"].values() if name in f["weights"]] for name in
            ("0.wte.weight", "1.attn.qkv.weight", "1.ln_1.weight")}  # fmt: skip
    assert held == {"0.wte.weight": [0], "1.attn.qkv.weight": [0, 1], "1.ln_1.weight": [0]}  # slices on each rank
    assert "1.attn.qkv.weight" in manifest["parameters"] and manifest["parameters"]["1.attn.qkv.weight"] == [96, 32]


def test_a_stage_reads_only_the_files_holding_its_parameters(tmp_path, caplog):
    _losses(_run(tmp_path, stages=3, microbatches=4), iterations=2)
    caplog.set_level(logging.DEBUG, logger="rrfp_ray.train.workload")
    with gpt_trainer(_run(tmp_path, resume=True, stages=3, microbatches=4)):
        read = [r.getMessage() for r in caplog.records if "checkpoint files read" in r.getMessage()]
    assert sorted(read) == [f"stage {s}: 1 of 3 checkpoint files read" for s in range(3)]


def test_a_pipeline_of_another_global_batch_is_refused_naming_both(tmp_path):
    _losses(_run(tmp_path, stages=2, dp=2, microbatches=2), iterations=2)
    with pytest.raises(CheckpointError, match=r"D x M = 2 x 2 = 4 .* this pipeline D x M = 3 x 1 = 3"):
        gpt_trainer(_run(tmp_path, resume=True, stages=2, dp=3, microbatches=1, policy="bfw"))


CLI = ["--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--seq-len", "16"]


def test_the_job_keeps_the_global_batch_when_d_shrinks_and_refuses_a_d_that_does_not_divide_it(tmp_path, capsys):
    _losses(_run(tmp_path, stages=2, dp=2, microbatches=2), iterations=2)
    _, run = train_gpt.parse([*CLI, "--resume", "--checkpoint-dir", str(tmp_path), "--stages", "2", "--dp", "1"])
    assert (run.pipeline.dp, run.pipeline.microbatches) == (1, 4)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse([*CLI, "--resume", "--checkpoint-dir", str(tmp_path), "--stages", "2", "--dp", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--dp 3 does not divide the checkpoint's global batch D x M = 2 x 2 = 4" in err


def test_another_model_is_refused_naming_the_first_parameter_that_differs(tmp_path):
    _losses(_run(tmp_path, **EVEN), iterations=2)
    other = _run(tmp_path, resume=True, **EVEN).model_copy(
        update={"model": _run().model.model_copy(update={"n_embd": 16})}
    )
    with pytest.raises(
        CheckpointError, match=r"another model: parameter 0.wte.weight is \[\d+, 32\] there, \[\d+, 16\]"
    ):
        gpt_trainer(other)


def test_a_checkpoint_of_the_chunk_indexed_format_is_refused_saying_so(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    old = {"iteration": 2, "fingerprint": "0123", "files": {"0": {"path": "iter-00000002/stage-0.pt", "sha256": "00"}}}
    (tmp_path / "manifest-00000002.json").write_text(json.dumps(old))
    with pytest.raises(CheckpointError, match="chunk-indexed format, which only the exact pipeline shape"):
        gpt_trainer(_run(tmp_path, resume=True, **EVEN))


@pytest.mark.parametrize("shape", [EVEN, {"stages": 2, "dp": 2, "zero": 1, "microbatches": 2}], ids=["plain", "ZeRO"])
def test_reshape_mid_run_trains_as_the_run_that_never_reshaped(tmp_path, reference, caplog, shape):
    caplog.set_level(logging.INFO, logger="rrfp_ray.train.api")

    def held() -> list[int]:  # replica 0's stages' parameter elements
        return [sum(p.numel() for p in e.runner.parameters()) for e in trainer.backend.executors[:2]]

    with gpt_trainer(_run(tmp_path / "ckpt", **shape)) as trainer:
        losses = [r.loss for r in trainer.fit(3)]
        before = held()
        seconds = trainer.reshape(layer_split=(1, 5))
        committed = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
        assert trainer.pipeline.layer_split == (1, 5) and trainer.workload.layer_split == (1, 5)
        after = held()
        assert after[0] < before[0] and after[1] > before[1]
        losses += [r.loss for r in trainer.fit(ITERATIONS - 3)]
    assert seconds > 0
    assert losses == pytest.approx(reference, rel=1e-4)
    assert committed == ["iter-00000002", "manifest-00000002.json", "model.json"]  # untouched by the reshape
    moved = [r.getMessage() for r in caplog.records if "moved" in r.getMessage()]
    assert (
        len(moved) == 1
        and "reshape at iteration 3: split 3,3 -> 1,5; layers 1-2 moved from stage 0 to stage 1 (" in moved[0]
    )


def test_reshape_refuses_a_split_that_does_not_fit_and_the_run_goes_on(reference):
    with gpt_trainer(_run(**EVEN)) as trainer:
        with pytest.raises(ValueError, match="1,1,4 must give each of the stages x chunks = 2"):
            trainer.reshape(layer_split=(1, 1, 4))
        with pytest.raises(ValueError, match="6 layers in all"):
            trainer.reshape(layer_split=(2, 2))
        assert trainer.step().loss == pytest.approx(reference[0], rel=1e-4)
