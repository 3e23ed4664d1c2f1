"""On Ray, a PP=2 x TP=2 GPT run through a recovery: the listeners of the stage actors bind the
node's address only and vanish with the pipeline; neither the agreement secret nor Ray's
token reaches the run directory, Ray's logs or this process's output."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
import ray
from ray._raylet import AuthenticationTokenLoader

from actors.backend import RayBackend
from jobs.train_gpt import train
from rrfp_ray.cli import write_pictures
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer

WILDCARDS = ("0.0.0.0", "::")


def _run(directory: Path) -> RunConfig:
    return RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16},
        pipeline={"stages": 2, "microbatches": 4, "policy": "bf", "tp": 2, "timeout_s": 30},
        train={
            "iterations": 2,
            "micro_batch_size": 2,
            "seq_len": 16,
            "val_every": 0,
            "checkpoint_dir": str(directory / "checkpoints"),
            "checkpoint_every": 1,
            "max_restarts": 1,
        },
        variability={"scenario": "lognormal", "t_f": 2.0},
    )


@ray.remote(num_cpus=0)
class _Bare:
    """An actor that opens nothing itself: what Ray alone listens on."""

    def listening(self) -> tuple[int, list[str]]:
        import psutil  # Ray vendors it; importable once ray is imported

        process = psutil.Process()
        sockets = process.net_connections(kind="tcp")
        return process.pid, sorted(f"{s.laddr.ip}:{s.laddr.port}" for s in sockets if s.status == psutil.CONN_LISTEN)


def _wildcards(addresses: list[str]) -> int:
    return sum(address.rsplit(":", 1)[0] in WILDCARDS for address in addresses)


def _secret(stages: list) -> bytes:
    """The agreement secret the stage actors hold (all ranks of a wiring share one)."""
    held = ray.get([a.__ray_call__.remote(lambda actor: actor._agreement._member.secret.value) for a in stages])
    assert len(set(held)) == 1
    return held[0]


def _listening(stages: list) -> dict[int, list[str]]:
    return dict(ray.get([a.listening.remote() for a in stages]))


def _gone(pids: list[int], *, timeout_s: float = 30.0) -> bool:
    """Whether every process in `pids` has exited within `timeout_s` (Ray kills actors asynchronously)."""
    import psutil  # Ray vendors it; importable once ray is imported

    def alive(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(map(alive, pids))


def _forms(secret: bytes) -> list[bytes]:
    return [
        secret,
        secret.hex().encode(),
        base64.b64encode(secret),
        base64.urlsafe_b64encode(secret),
        repr(secret)[2:-1].encode(),
    ]


@pytest.mark.slow  # two wirings, a kill and a rebuild of 4 actors: `make test-slow`
def test_listeners_are_narrow_and_close_and_secrets_stay_out_of_files(ray_session, tmp_path, capfd, caplog):
    run = _run(tmp_path)
    with gpt_trainer(run, backend=RayBackend()) as trainer:
        first = ray.get(trainer.backend.driver.stage_actors.remote())
        listening = _listening(first)
        secrets = [_secret(first)]
        summary, reports = train(trainer=trainer, run=run, policy="bf", out=tmp_path)
        ray.kill(first[1])
        trainer.step()  # fails on the lost stage, rebuilds the pipeline from the last checkpoint
        assert trainer.restarts == 1
        second = ray.get(trainer.backend.driver.stage_actors.remote())
        assert _gone(list(listening)), "the first pipeline's actor processes (and their listeners) outlived it"
        relisting = _listening(second)
        secrets.append(_secret(second))
        (tmp_path / "summary.json").write_text(json.dumps(summary))
        write_pictures(out=tmp_path, runs={"bf": reports})
    assert _gone(list(relisting)), "the stage actor processes (and their listeners) outlived the run"
    _, bare = ray.get(_Bare.remote().listening.remote())
    for pid, addresses in {**listening, **relisting}.items():
        # Ray's own worker server listens on every interface, in any actor; each of ours (group
        # stores, gloo pairs) listens on the node's address only
        assert _wildcards(addresses) == _wildcards(bare) == 1, (pid, addresses)
    assert sorted(map(len, listening.values())) == sorted(map(len, relisting.values()))  # a rebuild leaks none
    assert secrets[0] != secrets[1]  # a fresh secret for every wiring

    token = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)
    assert token
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    files = [p for p in [*tmp_path.rglob("*"), *logs.rglob("*")] if p.is_file()]
    assert any(p.name == "summary.json" for p in files) and any(p.suffix == ".pt" for p in files)
    captured = capfd.readouterr()
    texts = {str(p): p.read_bytes() for p in files} | {
        "stdout": captured.out.encode(),
        "stderr": captured.err.encode(),
        "log records": caplog.text.encode(),
    }
    forbidden = [form for secret in secrets for form in _forms(secret)] + [token.encode()]
    leaks = [(where, form[:8]) for where, text in texts.items() for form in forbidden if form in text]
    assert not leaks
