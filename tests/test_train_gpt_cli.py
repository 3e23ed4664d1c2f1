"""Bad input to jobs/train_gpt.py is a clear error naming the flag, before Ray starts (in-process)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import train_gpt
from rrfp_ray.runtime.transport import LinkTransport

JOB = Path(__file__).resolve().parent.parent / "jobs" / "train_gpt.py"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--stages", "4", "--chunks", "2"], "--stages x --chunks = 8 is more than the model's 6 layers"),
        (["--seq-len", "100"], "--seq-len 100 is over --block-size 64"),
        (["--micro-batch-size", "0"], "--micro-batch-size: Input should be greater than or equal to 1"),
        (["--policy", "fastest"], "unknown policy 'fastest'"),
        (["--cap", "0"], "--cap: cap must be >= 1 microbatch"),
        (["--scenario", "gremlins"], "unknown scenario"),
        (["--n-embd", "30", "--n-head", "4"], "n_embd (30) must be a multiple of n_head (4)"),
        (["--dp", "0"], "--dp: Input should be greater than or equal to 1"),
        (["--zero", "1"], "zero 1 shards the optimizer state over the DP replicas: it needs dp >= 2, got dp 1"),
        (["--precision", "fp16"], "--precision: Input should be 'fp32' or 'bf16'"),
    ],
)
def test_bad_flags_exit_with_the_flag_named(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_data_path_without_text_is_named(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(SystemExit):
        train_gpt.parse(["--data", str(tmp_path / "empty.txt")])
    assert f"--data {tmp_path / 'empty.txt'}: no text found" in capsys.readouterr().err


def test_the_defaults_parse(capsys):
    _, run = train_gpt.parse([])
    assert (run.pipeline.stages, run.pipeline.policy, str(run.pipeline.cap), run.train.iterations) == (
        4,
        "planned",
        "1x",
        30,
    )


def test_a_hint_that_deadlocks_is_refused_with_the_grid(tmp_path, capsys):
    hint = tmp_path / "hint.json"
    hint.write_text('{"0": ["0F0", "0B0", "0F1", "0B1"], "1": ["1F1", "1B0", "1F0", "1B1"]}')
    with pytest.raises(SystemExit):
        train_gpt.parse(["--stages", "2", "--microbatches", "2", "--policy", "hint", "--hint", str(hint)])
    err = capsys.readouterr().err
    assert "invalid pipeline order" in err and ">1B0<" in err


def test_tp_that_does_not_divide_the_heads_is_named(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse(["--tp", "3"])
    assert "--tp 3 does not divide --n-head 4" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--backend", "nccl"], "--backend nccl: no CUDA device is visible"),
        (["--gpus-per-stage", "-1"], "--gpus-per-stage must be >= 0, got -1"),  # refused before placement
    ],
)
def test_gpu_flags_without_cuda_fail_before_ray_starts(flags, expected, monkeypatch, capsys, tmp_path):
    """Through main(), with Ray's start made to fail (tests/test_bad_input.py runs the job as a process)."""

    def no_ray(**_):
        raise AssertionError("Ray started")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # no cluster: the stages would run here
    monkeypatch.setattr("actors.train_gpt.start_ray", no_ray)
    monkeypatch.chdir(tmp_path)  # the default --out, had the flags passed
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.main(flags)
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert expected in err
    assert "Traceback" not in err
    assert out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--gpu"], "--gpu: no CUDA device is visible"),
        (["--gpus-per-stage", "0.5"], "--gpus-per-stage 0.5: no CUDA device is visible"),
        (["--gpu", "--gpus-per-stage", "2"], "--gpu means --gpus-per-stage 1; it contradicts --gpus-per-stage 2"),
    ],
)
def test_gpus_without_cuda_are_named(flags, expected, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse(flags)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_flags_pass_when_attaching_to_a_cluster(monkeypatch):
    """Under RAY_ADDRESS the stages run on the cluster's nodes, not here: nothing to check locally."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    _, run = train_gpt.parse(["--backend", "nccl", "--gpu"])
    assert run.pipeline.backend is LinkTransport.NCCL and run.train.device == "cuda"


def _manifest(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "manifest-00000004.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda d: None, "the checkpoint directory {d} does not exist"),
        (lambda d: d.mkdir(), "no manifest-*.json in {d}"),
        (lambda d: _manifest(d, ""), "{d}/manifest-00000004.json: the manifest is empty"),
        (lambda d: _manifest(d, '{"iteration": 4, "fing'), "{d}/manifest-00000004.json: the manifest is not JSON"),
        (lambda d: _manifest(d, '{"iteration": 4}'), "{d}/manifest-00000004.json: the manifest lacks a field"),
        (
            lambda d: _manifest(d, '{"iteration": 4, "fingerprint": "0123", "files": {}}'),
            "{d}/manifest-00000004.json: this checkpoint was written in the chunk-indexed format",
        ),
    ],
    ids=["missing directory", "no manifest", "empty", "truncated", "no fields", "old format"],
)
def test_resume_from_a_bad_checkpoint_is_a_clean_error_naming_the_file(setup, expected, tmp_path, capsys):
    directory = tmp_path / "checkpoints"
    setup(directory)
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse(["--resume", "--checkpoint-dir", str(directory)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: --resume: " in err and expected.format(d=directory) in err
    assert "Traceback" not in err


def test_resume_with_a_stage_file_missing_names_it(tmp_path, capsys):
    run = train_gpt.parse(["--checkpoint-dir", str(tmp_path)])[1]
    from rrfp_ray.recipes.gpt_workload import gpt_workload
    from rrfp_ray.train.build import model_parameters, pipeline_shape
    from rrfp_ray.train.checkpoint import Manifest, StageFile, commit, parameters_fingerprint

    layers = gpt_workload(run).layers()
    parameters = model_parameters(layers)
    manifest = Manifest(
        iteration=4,
        fingerprint=parameters_fingerprint(parameters),
        files={0: StageFile(path="iter-00000004/stage-0.pt", sha256="00")},
        shape=pipeline_shape(pipeline=run.pipeline, n_layers=len(layers)),
        parameters=parameters,
    )
    commit(directory=tmp_path, manifest=manifest)
    with pytest.raises(SystemExit):
        train_gpt.parse(["--resume", "--checkpoint-dir", str(tmp_path)])
    assert f"its file {tmp_path}/iter-00000004/stage-0.pt is missing" in capsys.readouterr().err


def test_op_times_say_how_much_of_an_op_was_an_injected_sleep(capsys):
    from rrfp_ray.observe.telemetry import IterationReport, OpEvent
    from rrfp_ray.recipes.gpt_run import op_times, source_lines

    _, run = train_gpt.parse(["--stages", "2", "--microbatches", "2", "--scenario", "none"])
    event = OpEvent(stage=0, action="0F1", start_ms=0.0, end_ms=3.0, ready_ms=0.0, hint_pos=0, overtook=False)
    reports = [IterationReport(iteration=0, policy="bf", makespan_ms=3.0, stages=[], events=[event])]
    assert op_times(run=run, reports=reports) == {"op_ms_mean": 3.0, "injected_ms_mean": 0.0}
    assert source_lines(op_times(run=run, reports=reports)) == []  # nothing injected: nothing to explain
    _, run = train_gpt.parse(["--stages", "2", "--microbatches", "2", "--scenario", "lognormal", "--t-f", "2"])
    traces = run.variability.traces(pipeline=run.pipeline, iterations=run.train.iterations)
    assert traces[0] == run.variability.trace(pipeline=run.pipeline) and traces[0] != traces[1]
    times = op_times(run=run, reports=reports)
    assert times["injected_ms_mean"] == traces[0].F[0][1] > 0  # the trace's forward of microbatch 1 on stage 0
    [line] = source_lines(times)
    assert f"{times['injected_ms_mean']:.1f} ms of it an injected sleep" in line
    # iteration 1 sleeps its own trace's row of the data microbatch its slot 1 held
    later = [IterationReport(iteration=1, policy="bf", makespan_ms=3.0, stages=[], events=[event], order=[1, 0])]
    assert op_times(run=run, reports=later)["injected_ms_mean"] == traces[1].F[0][0]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--placement-timeout", "0"], "--placement-timeout: Input should be greater than 0"),
        (["--placement-timeout", "-5"], "--placement-timeout: Input should be greater than 0"),
        (["--stage-resources", "[1]"], "--stage-resources: a JSON object of resource amounts"),
        (
            ["--stage-resources", '{"GPU": 1}'],
            "--stage-resources: 'GPU': every stage asks 1 CPU, and GPUs come from --gpus-per-stage",
        ),
        (
            ["--stage-resources", '{"accelerator_type:A10G": 0}'],
            "--stage-resources: 'accelerator_type:A10G': amounts must be > 0",
        ),
    ],
)
def test_placement_flags_are_checked(flags, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_gpt.parse(flags)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_outputs_default_to_the_home_on_a_cluster(monkeypatch, tmp_path):
    """Under `ray job submit` the working dir is a temporary unpacked copy: outputs go under ~."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args, _ = train_gpt.parse([])
    assert args.out == "runs/train_gpt"
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("HOME", str(tmp_path))
    args, _ = train_gpt.parse(["--stage-resources", '{"accelerator_type:A10G": 0.001}', "--placement-timeout", "30"])
    assert Path(args.out).parent == tmp_path / "rrfp-runs"
    assert args.placement.resources == {"accelerator_type:A10G": 0.001} and args.placement.timeout_s == 30


def test_the_dp_line_prints_the_bytes_summed_and_received_and_their_share() -> None:
    from rrfp_ray.recipes.gpt_run import state_lines

    summary = {
        "policy": "bfw",
        "optim_bytes_per_actor": 2**20,
        "dp_reduce_bytes": 4 * 2**20,
        "dp_received_bytes": 2 * 2**20,
    }
    summary |= {"dp_received_share": 0.5, "dp_reduce_ms": 12.0, "dp_exposed_fraction": 0.25}
    assert state_lines(summary) == [
        (
            "[bfw] optimizer state per actor: at most 1.00 MiB; DP reduce per stage: 4.00 MiB summed, "
            "2.00 MiB of sums received (share 0.50), 12.0 ms, exposed 25%"
        )
    ]
    assert state_lines({"policy": "bfw"}) == []  # no DP


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], ["1f1b", "zb-h1"]),
        (["--policy", "zb-h1"], ["1f1b"]),
        (["--chunks", "2", "--n-layer", "8"], ["interleaved", "zb-interleaved"]),
        (["--checkpoint-every", "5"], []),
    ],
)
def test_the_job_compares_with_the_fixed_schedules_at_equal_memory(flags, expected, tmp_path):
    from rrfp_ray.recipes.gpt_cli import baselines_of

    _, run = train_gpt.parse([*flags, "--out", str(tmp_path)])
    assert baselines_of(run, compare=True) == expected
    assert baselines_of(run, compare=False) == []


def _reports(policy: str, *, losses: list[float], ms: float) -> list:
    from rrfp_ray.observe.telemetry import IterationReport

    return [
        IterationReport(iteration=i, policy=policy, makespan_ms=ms, stages=[], loss=x) for i, x in enumerate(losses)
    ]


def test_the_closing_lines_name_the_faster_fixed_schedule_the_memory_and_whether_losses_agree():
    from rrfp_ray.policy.caps import Cap
    from rrfp_ray.recipes.gpt_run import compared, outcome_lines

    def summary(policy: str, ms: float) -> dict:
        return {"policy": policy, "loss_first": 5.0, "loss_last": 4.0, "iteration_ms_median": ms}

    runs = {
        "1f1b": _reports("1f1b", losses=[5.0, 4.0], ms=120.0),
        "zb-h1": _reports("zb-h1", losses=[5.0, 4.0], ms=110.0),
        "planned": _reports("planned", losses=[5.0 * (1 + 1e-7), 4.0 * (1 + 1e-3)], ms=100.0),
    }
    baselines = {"1f1b": summary("1f1b", 120.0), "zb-h1": summary("zb-h1", 110.0)}
    own = summary("planned", 100.0) | {"val_loss_last": None, "tokens_per_s": 1000.0}
    own |= compared(own, baselines=baselines, runs=runs, cap=Cap.parse("1x"))
    assert own["baseline"]["policy"] == "zb-h1"
    assert own["speedup_vs_baseline"] == pytest.approx(1.1)
    lines = outcome_lines(own)
    assert "speedup of planned over the faster fixed schedule, zb-h1, at equal activation memory (cap 1x" in lines[3]
    assert lines[3].endswith(": 1.10x")
    assert "by 1.0e-07 (equal within 1e-05" in lines[4] and "to 1.0e-03 at most over the run" in lines[4]
    runs["planned"] = _reports("planned", losses=[5.1, 4.1], ms=100.0)
    own |= compared(own, baselines=baselines, runs=runs, cap=Cap.parse("2x"))
    lines = outcome_lines(own)
    assert "with cap 2x (the fixed schedules hold 1x: not equal memory)" in lines[3]
    assert "(DIFFERENT within 1e-05" in lines[4]
