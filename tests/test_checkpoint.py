"""Checkpoint files and manifests: atomic, verified, newest complete one wins."""

from __future__ import annotations

import json

import pytest
import torch

from rrfp_ray.train.checkpoint import Manifest, Shape, commit, fingerprint, latest, load_stage, save_stage

FP = fingerprint("model", 2, 1)
SHAPE = Shape(stages=2, tp=1, dp=1, chunks=1, placement="looped", layer_split=(1, 1), zero=0, microbatches=4)


def _checkpoint(directory, iteration, stages=2):
    files = {
        s: save_stage(
            directory=directory, iteration=iteration, stage=s, state={"w": torch.full((3,), float(iteration + s))}
        )
        for s in range(stages)
    }
    commit(
        directory=directory,
        manifest=Manifest(iteration=iteration, fingerprint=FP, files=files, shape=SHAPE, parameters={"0.w": (3,)}),
    )


def test_round_trip_and_newest_wins(tmp_path):
    _checkpoint(tmp_path, 5)
    _checkpoint(tmp_path, 10)
    manifest = latest(directory=tmp_path, fingerprint=FP)
    assert manifest.iteration == 10
    state = load_stage(directory=tmp_path, file=manifest.files[1])
    torch.testing.assert_close(state["w"], torch.full((3,), 11.0))


def test_no_checkpoint_is_none(tmp_path):
    assert latest(directory=tmp_path / "missing", fingerprint=FP) is None
    assert latest(directory=tmp_path, fingerprint=FP) is None


def test_a_stage_file_written_without_its_manifest_is_ignored(tmp_path):
    _checkpoint(tmp_path, 5)
    save_stage(directory=tmp_path, iteration=10, stage=0, state={"w": torch.zeros(3)})  # crash before commit
    assert latest(directory=tmp_path, fingerprint=FP).iteration == 5


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path):
    _checkpoint(tmp_path, 5)
    _checkpoint(tmp_path, 10)
    (tmp_path / "iter-00000010" / "stage-1.pt").write_bytes(b"torn write")
    assert latest(directory=tmp_path, fingerprint=FP).iteration == 5


def test_a_truncated_manifest_is_passed_over(tmp_path):
    _checkpoint(tmp_path, 5)
    (tmp_path / "manifest-00000010.json").write_text('{"iteration": 10, "fing')
    assert latest(directory=tmp_path, fingerprint=FP).iteration == 5


def test_a_mismatched_checkpoint_is_an_error(tmp_path):
    _checkpoint(tmp_path, 5)
    with pytest.raises(ValueError, match="another model"):
        latest(directory=tmp_path, fingerprint=fingerprint("other", 4, 1))


def test_a_corrupt_file_is_an_error_on_load(tmp_path):
    _checkpoint(tmp_path, 5)
    manifest = latest(directory=tmp_path, fingerprint=FP)
    (tmp_path / manifest.files[0].path).write_bytes(b"garbage")
    with pytest.raises(ValueError, match="corrupt"):
        load_stage(directory=tmp_path, file=manifest.files[0])


def test_no_temp_files_are_left(tmp_path):
    _checkpoint(tmp_path, 5)
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    assert json.loads((tmp_path / "manifest-00000005.json").read_text())["iteration"] == 5


class _Payload:
    """Unpickling this would create `path`: the code a tampered checkpoint could run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_a_checkpoint_holding_code_is_refused_and_nothing_runs(tmp_path):
    _checkpoint(tmp_path, 5)
    manifest = latest(directory=tmp_path, fingerprint=FP)
    planted = tmp_path / "planted-by-the-checkpoint"
    tampered = save_stage(directory=tmp_path, iteration=5, stage=0, state={"w": torch.zeros(3), "x": _Payload(planted)})
    assert tampered.path == manifest.files[0].path  # the tampered file replaced a good one, digest matching
    refused = r"holds objects other than tensors and plain data \(io.open\), so it was refused unread"
    with pytest.raises(ValueError, match=refused):
        load_stage(directory=tmp_path, file=tampered)
    assert not planted.exists()


def test_a_runner_state_round_trips_as_data(tmp_path):
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, betas=(0.9, 0.95))
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = {"chunks": {0: module.state_dict()}, "optimizer": optimizer.state_dict()}
    loaded = load_stage(directory=tmp_path, file=save_stage(directory=tmp_path, iteration=1, stage=0, state=state))
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    torch.testing.assert_close(loaded["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    torch.testing.assert_close(loaded["chunks"][0]["weight"], module.weight.detach())
