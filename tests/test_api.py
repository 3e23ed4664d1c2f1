"""The public API on the local backend: gradients equal the unsplit model's, bad input is a
ValueError before any stage starts, shapes may change per microbatch, the docs run."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from gradients import GradCapture
from torch import Tensor, nn
from toy_vlm import SPLIT_POINTS, Captions, ToyVLM, text_loss

from examples.mlp import Regression, mlp
from rrfp_ray import FactoryOptim, InMemoryData, LocalBackend, Optim, PipelineConfig, Trainer
from rrfp_ray.policy.agreement import TPProtocol
from rrfp_ray.policy.caps import Cap
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.train.layers import to_layers
from rrfp_ray.train.partition import partition

ROOT = Path(__file__).resolve().parent.parent


class _SpyBackend(LocalBackend):
    def __init__(self) -> None:
        super().__init__()
        self.started = False

    def start(self, **kwargs) -> None:
        self.started = True
        super().start(**kwargs)


@dataclass(frozen=True)
class _Tokens:
    """Byte-like tokens whose sequence length differs per microbatch (and per iteration)."""

    microbatches: int
    vocab: int = 11

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(1000 * iteration + index)
        seq = torch.randint(0, self.vocab, (3, 4 + 3 * index + iteration + 1), generator=g)
        return seq[:, :-1], seq[:, 1:]


def _token_model() -> nn.Sequential:
    return nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 11))


def _token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


CASES = {
    "mlp": {"model": mlp, "loss_fn": nn.functional.mse_loss, "data": Regression(microbatches=4)},
    "multimodal": {
        "model": ToyVLM,
        "split_points": SPLIT_POINTS,
        "loss_fn": text_loss,
        "data": Captions(microbatches=4),
    },
    "varlen": {"model": _token_model, "loss_fn": _token_loss, "data": _Tokens(microbatches=4)},
}


def _trainer(case: str, *, policy: str, stages: int = 2, chunks: int = 1, **overrides) -> Trainer:
    args = {"optimizer": Optim(lr=1e-2, warmup=0, total=10), **CASES[case], **overrides}
    pipeline = PipelineConfig(stages=stages, chunks=chunks, microbatches=4, policy=policy, timeout_s=30)
    return Trainer(pipeline=pipeline, **args)


def _reference(trainer: Trainer, *, iteration: int) -> tuple[float, list[list[Tensor]]]:
    """The unsplit model's mean loss on `iteration`, and each stage's expected gradients."""
    layers, pipeline = trainer.workload.layers, trainer.pipeline
    model = layers.model()
    data = trainer.workload.data
    batches = [data.microbatch(iteration=iteration, index=m) for m in range(pipeline.microbatches)]
    loss = sum(trainer.workload.loss_fn(model(x), y) for x, y in batches) / len(batches)
    loss.backward()
    groups = to_layers(model, split_points=layers.split_points)
    p, v = pipeline.stages, pipeline.chunks
    parts = partition(n_layers=len(groups), parts=p * v)
    grads = [[w.grad for c in range(v) for i in parts[c * p + s] for w in groups[i].parameters()] for s in range(p)]
    return float(loss.detach()), grads


@pytest.mark.parametrize(
    ("case", "policy", "stages", "chunks"),
    [
        ("mlp", "1f1b", 2, 1),
        ("mlp", "bf", 2, 1),
        ("mlp", "bfw", 2, 2),
        ("multimodal", "1f1b", 4, 1),  # split_points make 4 parts
        ("multimodal", "bf", 2, 2),
        ("multimodal", "interleaved", 2, 2),
        ("multimodal", "bfw", 4, 1),
        ("varlen", "1f1b", 2, 1),
        ("varlen", "bf", 2, 2),
    ],
)
def test_gradients_equal_the_unsplit_model(case, policy, stages, chunks):
    with _trainer(case, policy=policy, stages=stages, chunks=chunks) as trainer:
        captures = [GradCapture(e) for e in trainer.backend.executors]
        trainer.backend.executors = captures
        report = trainer.step()
        loss, expected = _reference(trainer, iteration=0)
    assert report.loss == pytest.approx(loss, rel=1e-5)
    for capture, want in zip(captures, expected):
        assert len(capture.grads) == len(want) > 0
        for got, ref in zip(capture.grads, want):
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


def test_fit_over_changing_shapes_then_reset_replays_the_first_iteration():
    data = _Tokens(microbatches=4)
    lengths = {data.microbatch(iteration=i, index=m)[0].shape[1] for i in range(2) for m in range(4)}
    assert len(lengths) == 8  # every microbatch of both iterations has its own sequence length
    with _trainer("varlen", policy="bf", chunks=2) as trainer:
        reports = trainer.fit(2)
        trainer.reset()
        again = trainer.step()
    assert [r.iteration for r in reports] == [0, 1]
    assert again.loss == pytest.approx(reports[0].loss, rel=1e-6)


def test_built_modules_are_copied_not_trained_in_place():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with _trainer("mlp", policy="bf", model=model) as trainer:
        first = trainer.step()
        second = trainer.step()
    assert second.loss != first.loss
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_a_factory_optimizer_keeps_its_own_learning_rates():
    def sgd(params):
        frozen = [p for p in params if p.dim() >= 2]
        moving = [p for p in params if p.dim() < 2]
        return torch.optim.SGD([{"params": frozen, "lr": 0.0}, {"params": moving, "lr": 0.5}])

    pipeline = PipelineConfig(stages=2, microbatches=4, policy="bf", timeout_s=30)
    with Trainer(
        model=mlp, loss_fn=nn.functional.mse_loss, data=Regression(microbatches=4), optimizer=sgd, pipeline=pipeline
    ) as trainer:
        before = [[p.detach().clone() for p in e.runner.parameters()] for e in trainer.backend.executors]
        trainer.step()
        after = [list(e.runner.parameters()) for e in trainer.backend.executors]
    for old, new in zip(before, after):
        for b, p in zip(old, new):
            assert torch.equal(b, p) == (p.dim() >= 2)


@pytest.mark.parametrize("max_norm", [1e-3, math.inf])
def test_a_factory_optimizer_clips_by_the_global_norm_only_when_asked(max_norm):
    optimizer = FactoryOptim(factory=lambda params: torch.optim.SGD(params, lr=1.0), max_grad_norm=max_norm)
    with _trainer("mlp", policy="bf", optimizer=optimizer) as trainer:
        trainer.backend.executors = captures = [GradCapture(e) for e in trainer.backend.executors]
        before = [p.detach().clone() for c in captures for p in c.inner.runner.parameters()]
        trainer.step()
        after = [p.detach() for c in captures for p in c.inner.runner.parameters()]
    grad_norm = sum(float(g.square().sum()) for c in captures for g in c.grads) ** 0.5
    step_norm = sum(float((a - b).square().sum()) for a, b in zip(after, before)) ** 0.5
    assert grad_norm > 1e-2
    assert step_norm == pytest.approx(min(grad_norm, max_norm), rel=1e-3)


def _nonscalar(out, y):
    return (out - y) ** 2


def _bad_count(out, y):
    return ((out - y) ** 2).sum(), torch.ones(2)


class _Named(nn.Module):
    def forward(self, ids):
        return {"ids": ids, "name": "tokens"}


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(self.a(x) + x)


@dataclass(frozen=True)
class _Noisy:
    microbatches: int = 4

    def microbatch(self, *, iteration, index):
        return torch.randn(4, 16), torch.randn(4, 1)


@dataclass(frozen=True)
class _Strings:
    microbatches: int = 4

    def microbatch(self, *, iteration, index):
        return "text", torch.zeros(1)


_IDS = torch.arange(4)

BAD = [
    (
        {"model": [nn.Linear(16, 8), nn.Linear(8, 1)], "chunks": 2},
        "the model has 2 modules: too few to split into stages x chunks = 2 x 2 = 4 chunks",
    ),
    (
        {"loss_fn": _nonscalar},
        "loss_fn _nonscalar must return a scalar tensor, "
        "or a (sum, count) pair of scalar tensors, got loss of shape (32, 1)",
    ),
    ({"loss_fn": _bad_count}, "got count of shape (2,)"),
    ({"data": Regression(microbatches=3)}, "data.microbatches = 3 differs from the pipeline's microbatches = 4"),
    ({"val_data": Regression(microbatches=0)}, "val_data must declare `microbatches`"),
    ({"data": _Noisy()}, "data.microbatch(iteration=0, index=0) differs between two reads"),
    ({"data": _Strings()}, "data.microbatch inputs must be a tensor, or tuples, lists and dicts of tensors, got a str"),
    (
        {"model": [nn.Linear(16, 8), torch.tanh, nn.Linear(8, 1)]},
        "model[1] is builtin_function_or_method, not an nn.Module",
    ),
    ({"model": _Residual()}, "model is a _Residual, not nn.Sequential or a list of modules: give split_points"),
    ({"model": _Residual(), "split_points": ["b"]}, "the model's forward differs from running its split_points parts"),
    ({"model": _Residual(), "split_points": ["c"]}, "split_points ['c'] are not children of the model"),
    ({"model": _Residual(), "split_points": ["a"]}, "must be distinct, in forward order, and not cut before the first"),
    (
        {"model": ToyVLM, "split_points": ["blocks.2"], "chunks": 2},
        "split_points cut the model into 2 parts; the pipeline needs stages x chunks = 2 x 2 = 4",
    ),
    (
        {"model": [_Named(), nn.Embedding(5, 4)], "data": InMemoryData(batches=[(_IDS, _IDS)], microbatches=4)},
        (
            "virtual stage 0 (modules 0..0) returns a dict of ('ids': "
            "a torch.int64 tensor of shape (4,), 'name': a str): "
            "between stages only tensors, and tuples, lists and dicts (string keys) of them, can pass"
        ),
    ),
    (
        {"model": [nn.Linear(16, 8), nn.Linear(4, 1)]},
        "the dry forward of microbatch (0, 0) failed in virtual stage 1 (modules 1..1)",
    ),
    ({"optimizer": "adam"}, "optimizer must be an Optim or a factory"),
    ({"optimizer": lambda params: None}, "returned NoneType, not an Optimizer"),
    ({"model": lambda: "not a model"}, "returned str, not modules"),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD)
def test_bad_input_is_a_value_error_before_any_stage_starts(overrides, expected):
    spy = _SpyBackend()
    with pytest.raises(ValueError) as error:
        _trainer("mlp", policy="bf", backend=spy, **overrides)
    assert expected in str(error.value)
    assert not spy.started


def test_the_config_parses_cap_backend_and_protocol_once():
    """Text from a flag or a dict becomes a Cap and enums at the boundary; code downstream gets no strings."""
    config = PipelineConfig(cap="1.5x", backend="gloo", tp_protocol="first")
    assert (config.cap, config.backend, config.tp_protocol) == (Cap(multiple=1.5), LinkTransport.GLOO, TPProtocol.FIRST)
    assert PipelineConfig(cap=6).cap == Cap(count=6) == PipelineConfig(cap=Cap(count=6)).cap
    assert PipelineConfig(cap="inf").cap.limit(peak=3) == math.inf
    assert str(PipelineConfig().cap) == "2x"
    for bad, field in (({"cap": "0"}, "cap"), ({"cap": {"multiple": -1}}, "cap"), ({"backend": "mpi"}, "backend")):
        with pytest.raises(ValueError, match=field):
            PipelineConfig(**bad)


def test_evaluate_needs_val_data():
    with _trainer("mlp", policy="bf") as trainer, pytest.raises(ValueError, match="val_data"):
        trainer.evaluate()


def test_evaluate_is_the_unsplit_models_mean_validation_loss():
    val = Captions(microbatches=3, stream=1)
    with _trainer("multimodal", policy="bf", chunks=2, val_data=val) as trainer:
        got = trainer.evaluate()
        model = trainer.workload.layers.model()
    with torch.no_grad():
        want = (
            sum(float(text_loss(model(x), y)) for x, y in (val.microbatch(iteration=0, index=i) for i in range(3))) / 3
        )
    assert got == pytest.approx(want, rel=1e-5)


def test_the_readme_example_runs_as_printed():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Pipeline your own model", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    reports = namespace["reports"]
    assert len(reports) == 100
    assert reports[-1].loss < reports[0].loss / 10


def test_the_library_imports_no_ray():
    code = (
        "import sys, rrfp_ray; from rrfp_ray import Trainer, LocalBackend; "
        "import rrfp_ray.recipes.gpt_workload, rrfp_ray.train.dryrun; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'actors')); assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
