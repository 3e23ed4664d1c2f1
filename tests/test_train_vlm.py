"""jobs/train_vlm.py: bad input is a clear error naming the flag, before Ray starts (in-process);
and the job trains on the session's Ray with no injected delay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import train_vlm

JOB = Path(__file__).resolve().parent.parent / "jobs" / "train_vlm.py"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--max-images", "0"], "--max-images: Input should be greater than or equal to 1"),
        (["--image-size", "15"], "--patch-size 4 does not divide --image-size 15"),
        (["--image-tail", "-1"], "--image-tail must be >= 0, got -1"),
        (
            ["--encoder-embd", "30", "--encoder-heads", "4"],
            "--encoder-embd (30) must be a multiple of --encoder-heads (4)",
        ),
        (["--tp", "2"], "the VLM has no tensor-parallel layers: tp must be 1"),
        (["--varlen"], "--varlen: the VLM trains on captioned images, not text"),
        (
            ["--stages", "10", "--microbatches", "16", "--encoder-layers", "1"],
            "--stages x --chunks = 10 is more than the model's 9 layers",
        ),
        (["--stages", "2", "--split", "2,2"], "--split 2,2 holds 4 layers; the model has 12"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_vlm.parse(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_the_defaults_inject_nothing_and_size_the_decoder_from_the_gpt_flags():
    args, run, model = train_vlm.parse(["--n-layer", "3", "--n-embd", "32", "--max-images", "5"])
    assert run.variability.scenario == "none" and run.variability.trace_file is None
    assert (model.n_layer, model.n_embd, model.max_images) == (3, 32, 5)
    assert args.out == "runs/train_vlm"


SMALL = "--stages 2 --microbatches 2 --micro-batch-size 2 --encoder-layers 1 --n-layer 1 --max-images 2 --image-size 8"


def test_resume_finds_a_checkpoint_of_this_vlm_and_refuses_another_models(tmp_path, capsys):
    from rrfp_ray.recipes.vlm_workload import vlm_trainer

    flags = [*SMALL.split(), "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path)]
    args, run, model = train_vlm.parse([*flags, "--checkpoint-every", "1"])
    with vlm_trainer(run, model=model, tail=args.image_tail) as trainer:
        trainer.fit(1)
    args, run, model = train_vlm.parse([*flags, "--resume"])
    with vlm_trainer(run, model=model, tail=args.image_tail) as trainer:
        assert trainer.iteration == 1
    with pytest.raises(SystemExit) as exit_info:
        train_vlm.parse([*flags, "--resume", "--encoder-layers", "2"])
    assert exit_info.value.code == 2
    assert "--resume:" in capsys.readouterr().err


def test_train_vlm_job_trains(ray_session, tmp_path, monkeypatch, job_logging):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    flags = (
        "--iterations 8 --stages 2 --microbatches 4 --micro-batch-size 4 --encoder-layers 2 --n-layer 2 "
        "--encoder-embd 32 --n-embd 32 --max-images 4 --classes 4 --image-size 8 --no-compare"
    )
    summary = train_vlm.main([*flags.split(), "--out", str(tmp_path)])
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["iterations"] == 8 and summary["injected_ms_mean"] == 0.0
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["val_loss_last"] is not None


def test_the_job_counts_the_vlms_own_layers():
    from rrfp_ray.models.vlm import VLM, VLMConfig

    for config in (VLMConfig(), VLMConfig(encoder_layers=1, n_layer=4)):
        assert config.layer_count == len(VLM(config, seed=0).layers())
    _, run, model = train_vlm.parse(["--stages", "7", "--n-layer", "4"])  # the GPT's count would be 6
    assert run.layers == model.layer_count == 12 and run.pipeline.stages == 7


def test_a_readiness_rule_gates_in_the_bytes_its_stages_measured_a_fixed_schedule_never():
    from rrfp_ray.recipes.vlm_workload import vlm_trainer

    args, run, model = train_vlm.parse([*SMALL.split(), "--cap", "1x"])
    with vlm_trainer(run, model=model, tail=args.image_tail) as trainer:
        first = trainer.step(policy="bf")  # nothing measured yet: the cap counts microbatches
        second = trainer.step(policy="bf")
        fixed = trainer.step(policy="1f1b")
    assert all(not s.gate_bytes for s in first.stages)
    assert all(s.activation_bytes for s in first.stages)
    assert all(len(s.gate_bytes) == run.pipeline.microbatches for s in second.stages)
    assert all(s.peak_bytes <= s.gate_limits[0] * 1.5 for s in second.stages if s.gate_limits[0] is not None)
    assert all(not s.gate_bytes for s in fixed.stages)
