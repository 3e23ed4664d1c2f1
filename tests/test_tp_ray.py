"""PP=2 x TP=2 on Ray: four stage actors, a TP group per stage agreeing on every op; the
losses and validation loss equal the PP=2 x TP=1 run's (run in-process: the backends train
alike, `tests/test_api_ray.py`). The `first` protocol's rounds are the same on either carrier
and are checked in-process (`tests/test_tp.py`)."""

from __future__ import annotations

import pytest

from actors.backend import RayBackend
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_trainer


def _run(
    tp: int, protocol: str = "common", gather: str = "tcp", *, ray: bool = True
) -> tuple[list[float], float, list]:
    run = RunConfig(
        model={"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16},
        pipeline={
            "stages": 2,
            "microbatches": 4,
            "policy": "bf",
            "tp": tp,
            "tp_protocol": protocol,
            "tp_gather": gather,
            "timeout_s": 30,
        },
        train={"iterations": 3, "micro_batch_size": 2, "seq_len": 16, "val_every": 0},
        variability={"scenario": "lognormal", "t_f": 2.0},
    )
    with gpt_trainer(run, backend=RayBackend() if ray else None) as trainer:
        reports = trainer.fit(3)
        return [r.loss for r in reports], trainer.evaluate(), reports


@pytest.fixture(scope="module")
def unsplit() -> tuple[list[float], float]:
    losses, val, _ = _run(tp=1, ray=False)
    return losses, val


@pytest.mark.parametrize(
    ("protocol", "gather"), [("common", "tcp"), pytest.param("common", "collective", marks=pytest.mark.slow)]
)
def test_tensor_parallel_stages_on_ray_train_like_unsplit_ones(ray_session, unsplit, protocol, gather):
    """Over either carrier of the agreement's all-gather (TCP connections, the TP group's all-gather)."""
    losses, val, reports = _run(tp=2, protocol=protocol, gather=gather)
    reference_losses, reference_val = unsplit
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert val == pytest.approx(reference_val, rel=1e-5)
    assert all(len(r.stages) == 2 for r in reports)  # one report per stage, from its TP rank 0
    assert all(s.tp_ms > 0 for r in reports for s in r.stages)
