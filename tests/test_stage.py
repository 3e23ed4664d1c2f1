import gc
import io
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rrfp_ray.models.gpt import GPT, GPTConfig, lm_loss
from rrfp_ray.train.data import Corpus
from rrfp_ray.train.optim import clip_coef, lr_at
from rrfp_ray.train.partition import partition, stage_chunks
from rrfp_ray.train.runner import StageRunner, build_stage

CONFIG = GPTConfig(
    block_size=16, n_layer=4, n_head=4, n_embd=32, tie_embeddings=False
)  # runners driven directly: no tie groups
M = 4
SEED = 7


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def _runners(
    *, stages: int, chunks: int, config: GPTConfig = CONFIG, microbatches: int = M
) -> tuple[list[StageRunner], list[nn.Parameter]]:
    """One runner per stage, each cut from its own freshly built model, as separate processes would.

    Also returns the runners' parameters in the unsplit model's order.
    """
    models = [GPT(config, seed=SEED) for _ in range(stages)]
    runners = [
        build_stage(
            layers=model.layers(),
            stages=stages,
            chunks=chunks,
            stage=s,
            loss_fn=lm_loss,
            loss_scale=1 / microbatches,
            optimizer_factory=_adamw,
        )
        for s, model in enumerate(models)
    ]
    parts = partition(n_layers=config.n_layer + 2, parts=stages * chunks)
    params = [p for vs, part in enumerate(parts) for i in part for p in models[vs % stages].layers()[i].parameters()]
    return runners, params


def _microbatches(*, batch: int = 2, length: int = 16) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 256, (batch, length), generator=generator) for _ in range(M)]
    ys = [torch.randint(0, 256, (batch, length), generator=generator) for _ in range(M)]
    return xs, ys


def _order(*, stages: int, chunks: int, split: bool, shuffle: random.Random | None) -> list[tuple[str, int, int]]:
    """(op, virtual stage, microbatch) in a valid dependency order.

    Without ``shuffle``: every forward in virtual-stage order, then every backward in reverse,
    then (split) every weight pass, deferred to the end in a scrambled order. With it: a random
    topological order of the same ops.
    """
    last = stages * chunks - 1
    ops = [(op, vs, m) for m in range(M) for vs in range(last + 1) for op in (("F", "B", "W") if split else ("F", "B"))]

    def need(op: str, vs: int, m: int) -> list[tuple[str, int, int]]:
        if op == "F":
            return [("F", vs - 1, m)] if vs > 0 else []
        if op == "B":
            return [("F", vs, m)] + ([("B", vs + 1, m)] if vs < last else [])
        return [("B", vs, m)]

    if shuffle is None:
        forward = [o for o in ops if o[0] == "F"]
        backward = sorted((o for o in ops if o[0] == "B"), key=lambda o: (o[2], -o[1]))
        weight = [o for o in ops if o[0] == "W"]
        random.Random(len(weight)).shuffle(weight)
        return forward + backward + weight
    done: set[tuple[str, int, int]] = set()
    order = []
    while len(order) < len(ops):
        ready = [o for o in ops if o not in done and all(n in done for n in need(*o))]
        pick = shuffle.choice(ready)
        done.add(pick)
        order.append(pick)
    return order


def _run(
    runners: list[StageRunner],
    *,
    chunks: int,
    order: list[tuple[str, int, int]],
    split: bool,
    flops: dict[tuple[str, int, int], int] | None = None,
) -> None:
    """Run ``order``; with ``flops``, record each backward op's matmul FLOPs there."""
    stages = len(runners)
    last = stages * chunks - 1
    xs, ys = _microbatches()
    activations: dict[tuple[int, int], torch.Tensor] = {}
    grads: dict[tuple[int, int], torch.Tensor | None] = {}
    for op, vs, m in order:
        runner, chunk = runners[vs % stages], vs // stages
        if op == "F":
            inputs = xs[m] if vs == 0 else activations.pop((vs - 1, m))
            out = runner.forward(chunk=chunk, microbatch=m, inputs=inputs, targets=ys[m] if vs == last else None)
            assert (out is None) == (vs == last)
            if out is not None:
                activations[(vs, m)] = out
            continue
        with FlopCounterMode(display=False) as counter:
            if op == "B":
                grad = None if vs == last else grads.pop((vs + 1, m))
                backward = runner.backward_input if split else runner.backward
                grads[(vs, m)] = backward(chunk=chunk, microbatch=m, grad=grad)
                assert (grads[(vs, m)] is None) == (vs == 0)
            else:
                runner.backward_weight(chunk=chunk, microbatch=m)
        if flops is not None:
            flops[(op, vs, m)] = counter.get_total_flops()


def _reference() -> tuple[GPT, list[float]]:
    """The unsplit model after backward of the mean loss over all microbatches as one batch."""
    model = GPT(CONFIG, seed=SEED)
    xs, ys = _microbatches()
    _, loss = model(torch.cat(xs), torch.cat(ys))
    assert loss is not None
    loss.backward()
    with torch.no_grad():
        per_microbatch = [lm_loss(model(x)[0], y).item() for x, y in zip(xs, ys)]
    return model, per_microbatch


@pytest.mark.parametrize(("stages", "chunks"), [(2, 2), (4, 1)])
@pytest.mark.parametrize("split", [False, True], ids=["B", "B+W"])
@pytest.mark.parametrize("shuffle", [None, 0, 1], ids=["in-order", "shuffled0", "shuffled1"])
def test_split_gradients_equal_the_unsplit_models(stages: int, chunks: int, split: bool, shuffle: int | None) -> None:
    reference, reference_losses = _reference()
    runners, params = _runners(stages=stages, chunks=chunks)
    for mine, theirs in zip(params, reference.parameters(), strict=True):
        assert torch.equal(mine, theirs)

    rng = None if shuffle is None else random.Random(shuffle)
    _run(runners, chunks=chunks, order=_order(stages=stages, chunks=chunks, split=split, shuffle=rng), split=split)

    for (name, theirs), mine in zip(reference.named_parameters(), params, strict=True):
        assert mine.grad is not None, name
        torch.testing.assert_close(mine.grad, theirs.grad, msg=lambda text, name=name: f"{name}: {text}")
    torch.testing.assert_close(runners[-1].losses(), reference_losses)
    assert all(r.losses() == [] for r in runners[:-1])
    total = sum(r.grad_sq_norm() for r in runners)
    expected = sum(p.grad.double().square().sum().item() for p in reference.parameters())
    assert total == pytest.approx(expected, rel=1e-5)
    assert [r.held_bytes() for r in runners] == [0] * stages
    assert all(r.peak_held_bytes > 0 for r in runners)


def test_weight_pass_does_the_work_the_input_pass_left() -> None:
    """Matmul FLOPs: input pass + weight pass == full backward, and each pass does its share."""
    full: dict[tuple[str, int, int], int] = {}
    split: dict[tuple[str, int, int], int] = {}
    for flops, is_split in ((full, False), (split, True)):
        runners, _ = _runners(stages=4, chunks=1)
        order = _order(stages=4, chunks=1, split=is_split, shuffle=None)
        _run(runners, chunks=1, order=order, split=is_split, flops=flops)
    for vs in range(4):
        for m in range(M):
            assert split[("B", vs, m)] + split[("W", vs, m)] == full[("B", vs, m)]
            assert split[("W", vs, m)] > 0
            assert (split[("B", vs, m)] > 0) == (vs > 0)


class _Reuse(nn.Module):
    """Applies one Linear twice: its weight feeds two places on the input path."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(torch.tanh(self.lin(x))))


@pytest.mark.parametrize("split", [False, True], ids=["B", "B+W"])
def test_a_weight_used_twice_gets_its_gradient_once(split: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Reuse(), nn.Linear(8, 8), _Reuse())
    x = torch.randn(4, 8)
    grad = torch.randn(4, 8)
    model(x.requires_grad_()).backward(grad)
    reference = [p.grad.clone() for p in model.parameters()] + [x.grad]
    model.zero_grad()
    runner = StageRunner(
        chunks={0: model}, first_chunk=None, last_chunk=None, loss_fn=lm_loss, loss_scale=1.0, optimizer_factory=_adamw
    )
    runner.forward(chunk=0, microbatch=0, inputs=x)
    if split:
        dx = runner.backward_input(chunk=0, microbatch=0, grad=grad)
        assert all(p.grad is None for p in model.parameters())
        runner.backward_weight(chunk=0, microbatch=0)
    else:
        dx = runner.backward(chunk=0, microbatch=0, grad=grad)
    for mine, theirs in zip([p.grad for p in model.parameters()] + [dx], reference, strict=True):
        torch.testing.assert_close(mine, theirs)


def test_held_bytes_follow_the_microbatch_life_cycle() -> None:
    (runner,), _ = _runners(stages=1, chunks=1)
    xs, ys = _microbatches()
    assert runner.held_bytes() == 0
    runner.forward(chunk=0, microbatch=0, inputs=xs[0], targets=ys[0])
    one = runner.held_bytes()
    logits_bytes = xs[0].numel() * 256 * 4
    assert one > logits_bytes
    runner.forward(chunk=0, microbatch=1, inputs=xs[1], targets=ys[1])
    assert runner.held_bytes() == 2 * one
    runner.backward(chunk=0, microbatch=0, grad=None)
    assert runner.held_bytes() == one
    runner.backward_input(chunk=0, microbatch=1, grad=None)
    assert runner.held_bytes() > one
    runner.backward_weight(chunk=0, microbatch=1)
    assert runner.held_bytes() == 0
    assert runner.peak_held_bytes == 2 * one
    runner.reset_iteration()
    assert runner.peak_held_bytes == 0


def test_split_backward_iterations_leave_no_tensor_behind() -> None:
    """The split backward retains each graph for its weight passes; a graph that outlives them
    (held through a C++ cycle the collector cannot see) is a leak of every activation."""
    (_, runner), _ = _runners(stages=2, chunks=1)
    _, ys = _microbatches()

    def live_tensors_after_an_iteration() -> int:
        for m, y in enumerate(ys):
            received = torch.randn(*y.shape, CONFIG.n_embd, requires_grad=True)
            runner.forward(chunk=0, microbatch=m, inputs=received, targets=y)
            runner.backward_input(chunk=0, microbatch=m, grad=None)
            runner.backward_weight(chunk=0, microbatch=m)
        runner.step(clip_coef=1.0, lr=None)
        runner.reset_iteration()
        gc.collect()
        return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())  # type(): no proxy's `__class__` read

    first = live_tensors_after_an_iteration()
    assert live_tensors_after_an_iteration() == first


def test_call_order_errors_name_chunk_and_microbatch() -> None:
    (first, second), _ = _runners(stages=2, chunks=1)
    xs, ys = _microbatches()
    with pytest.raises(RuntimeError, match="chunk 0 microbatch 3"):
        first.backward(chunk=0, microbatch=3, grad=None)
    with pytest.raises(RuntimeError, match="chunk 0 microbatch 2"):
        first.backward_weight(chunk=0, microbatch=2)
    act = first.forward(chunk=0, microbatch=0, inputs=xs[0])
    with pytest.raises(RuntimeError, match="chunk 0 microbatch 0"):
        first.forward(chunk=0, microbatch=0, inputs=xs[0])
    with pytest.raises(RuntimeError, match=r"unfinished for \(chunk, microbatch\) \[\(0, 0\)\]"):
        first.step(clip_coef=1.0, lr=1e-3)
    with pytest.raises(ValueError, match="chunk 1 is not on this stage"):
        first.forward(chunk=1, microbatch=0, inputs=xs[0])
    with pytest.raises(ValueError, match="targets are required"):
        second.forward(chunk=0, microbatch=0, inputs=act)
    with pytest.raises(ValueError, match="targets only apply"):
        first.forward(chunk=0, microbatch=1, inputs=xs[1], targets=ys[1])
    with pytest.raises(
        ValueError,
        match=r"grad for chunk 0 must be one tensor per differentiable output \[\(2, 16, 32\)\], got \[\(3,\)\]",
    ):
        first.backward(chunk=0, microbatch=0, grad=torch.zeros(3))


def test_non_scalar_loss_is_rejected_naming_loss_fn() -> None:
    def per_token(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")

    runner = build_stage(
        layers=GPT(CONFIG, seed=SEED).layers(),
        stages=1,
        chunks=1,
        stage=0,
        loss_fn=per_token,
        loss_scale=1.0,
        optimizer_factory=_adamw,
    )
    xs, ys = _microbatches()
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        runner.forward(chunk=0, microbatch=0, inputs=xs[0], targets=ys[0])


def test_constructor_rejects_chunks_it_does_not_hold() -> None:
    common = {"chunks": {0: nn.Sequential(nn.Linear(2, 2))}, "loss_fn": lm_loss, "optimizer_factory": _adamw}
    with pytest.raises(ValueError, match="first_chunk 1"):
        StageRunner(first_chunk=1, last_chunk=None, loss_scale=1.0, **common)
    with pytest.raises(ValueError, match="loss_scale"):
        StageRunner(first_chunk=0, last_chunk=0, loss_scale=0.0, **common)


def test_loss_falls_when_training_on_the_stdlib_corpus() -> None:
    config = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)
    corpus = Corpus.from_path(None)
    (runner,), _ = _runners(stages=1, chunks=1, config=config, microbatches=2)
    losses = []
    steps = 30
    for step in range(steps):
        runner.reset_iteration()
        for m in range(2):
            x, y = corpus.batch(
                split="train", iteration=step, index=m, micro_batch_size=8, seq_len=32, microbatches=2, seed=0
            )
            runner.forward(chunk=0, microbatch=m, inputs=x, targets=y)
            runner.backward(chunk=0, microbatch=m, grad=None)
        losses.append(sum(runner.losses()) / 2)
        coef = clip_coef(total_sq_norm=runner.grad_sq_norm(), max_norm=1.0)
        runner.step(clip_coef=coef, lr=lr_at(step=step, warmup=5, total=steps, lr=5e-3, min_lr=5e-4))
        assert runner.grad_sq_norm() == 0.0
    first, final = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 5.0
    assert final < first - 1.5


def test_state_dict_round_trip_continues_identically() -> None:
    xs, ys = _microbatches()

    def train_step(runner: StageRunner) -> None:
        runner.forward(chunk=0, microbatch=0, inputs=xs[0], targets=ys[0])
        runner.backward(chunk=0, microbatch=0, grad=None)
        runner.step(clip_coef=0.5, lr=1e-2)

    (trained,), _ = _runners(stages=1, chunks=1)
    for _ in range(2):
        train_step(trained)
    (restored,), _ = _runners(stages=1, chunks=1)
    checkpoint = io.BytesIO()
    torch.save(trained.state_dict(), checkpoint)
    checkpoint.seek(0)
    restored.load_state_dict(torch.load(checkpoint))
    for runner in (trained, restored):
        train_step(runner)
    for a, b in zip(trained.parameters(), restored.parameters(), strict=True):
        assert torch.equal(a, b)
    (_, other), _ = _runners(stages=2, chunks=1)
    with pytest.raises(ValueError, match="chunks"):
        other.load_state_dict({"chunks": {0: {}, 1: {}}, "optimizer": {}})


def test_partition_is_contiguous_and_balanced_larger_parts_first() -> None:
    assert partition(n_layers=6, parts=4) == [range(2), range(2, 4), range(4, 5), range(5, 6)]
    assert partition(n_layers=8, parts=4) == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition(n_layers=5, parts=1) == [range(5)]
    for n in range(1, 12):
        for parts in range(1, n + 1):
            ranges = partition(n_layers=n, parts=parts)
            assert [i for r in ranges for i in r] == list(range(n))
            sizes = [len(r) for r in ranges]
            assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1


@pytest.mark.parametrize(("n_layers", "parts"), [(5, 8), (5, 0), (0, 1)])
def test_partition_rejects_impossible_splits(n_layers: int, parts: int) -> None:
    with pytest.raises(ValueError, match=rf"cannot split {n_layers} layers into {parts} parts \(stages x chunks\)"):
        partition(n_layers=n_layers, parts=parts)


def test_stage_chunks_take_virtual_stage_c_times_stages_plus_stage() -> None:
    layers = [nn.Identity() for _ in range(6)]
    held = stage_chunks(layers=layers, stages=2, chunks=2, stage=1)
    # parts of 6 over 4 virtual stages: [0,1] [2,3] [4] [5]; stage 1 holds virtual stages 1 and 3
    assert [list(held[0]) == layers[2:4], list(held[1]) == layers[5:6]] == [True, True]
    with pytest.raises(ValueError, match="stage 2"):
        stage_chunks(layers=layers, stages=2, chunks=2, stage=2)


def test_lr_schedule_warms_up_linearly_then_decays_by_cosine() -> None:
    def lr(step: int) -> float:
        return lr_at(step=step, warmup=10, total=110, lr=1.0, min_lr=0.1)

    assert [lr(s) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    decay = [lr(s) for s in range(10, 111)]
    assert decay[0] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert lr(60) == pytest.approx(0.55)
    assert lr(110) == lr(500) == 0.1
    assert lr_at(step=0, warmup=0, total=10, lr=1.0, min_lr=0.0) == 1.0


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"step": -1}, "step"),
        ({"warmup": 20, "total": 10}, "warmup"),
        ({"min_lr": 2.0}, "min_lr"),
    ],
)
def test_lr_schedule_rejects_bad_arguments(kwargs: dict, name: str) -> None:
    args = {"step": 0, "warmup": 1, "total": 10, "lr": 1.0, "min_lr": 0.0} | kwargs
    with pytest.raises(ValueError, match=name):
        lr_at(**args)


def test_clip_coef() -> None:
    assert clip_coef(total_sq_norm=0.25, max_norm=1.0) == 1.0
    assert clip_coef(total_sq_norm=16.0, max_norm=1.0) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="max_norm"):
        clip_coef(total_sq_norm=1.0, max_norm=0.0)
    with pytest.raises(ValueError, match="total_sq_norm"):
        clip_coef(total_sq_norm=float("inf"), max_norm=1.0)
