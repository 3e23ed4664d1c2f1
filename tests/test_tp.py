"""Tensor parallelism inside a stage: readiness agreement and Megatron-style TP blocks."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from gradients import GradCapture, gpt_reference
from torch import nn

from rrfp_ray.models.gpt import GPT, Block, GPTConfig, lm_loss
from rrfp_ray.models.tp import TPBlock, TPLayers, check_tp, shard_block_tensors
from rrfp_ray.policy.agreement import Agreement, TPContext, TPProtocol, decide, offer, op_id
from rrfp_ray.policy.arbiter import Arbiter
from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.recipes.config import RunConfig
from rrfp_ray.recipes.gpt_workload import gpt_workload
from rrfp_ray.runtime.thread_collectives import ThreadAllGather, tensor_all_reduce
from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.train.backend import IterationSettings, LocalBackend
from rrfp_ray.train.partition import partition
from rrfp_ray.train.runner import StageRunner

TINY = {
    "n_layer": 4,
    "n_embd": 32,
    "n_head": 4,
    "block_size": 16,
    "tie_embeddings": False,
}  # driven without a Trainer: no tie groups


def _on_stage_0(kind: Kind, m: int, chunk: int = 0) -> Action:
    """An action of stage 0 of two (looped: chunk c is virtual stage 2c)."""
    return Placement.LOOPED.action(kind=kind, virtual_stage=2 * chunk, microbatch=m, stages=2)


def _f(m: int, chunk: int = 0) -> Action:
    return _on_stage_0(Kind.F, m, chunk)


def _b(m: int, chunk: int = 0) -> Action:
    return _on_stage_0(Kind.B, m, chunk)


def test_op_ids_are_distinct_per_action():
    actions = [_on_stage_0(k, m, c) for k in Kind for m in range(40) for c in range(3)]
    assert len({op_id(a) for a in actions}) == len(actions)
    assert all(op_id(a) >= 0 for a in actions)


def test_first_protocol_runs_only_a_unanimous_first_choice():
    assert decide(protocol=TPProtocol.FIRST, gathered=[[7], [7]]) == 7
    assert decide(protocol=TPProtocol.FIRST, gathered=[[7], [8]]) is None
    assert decide(protocol=TPProtocol.FIRST, gathered=[[7], [-1]]) is None
    assert decide(protocol=TPProtocol.FIRST, gathered=[[-1], [-1]]) is None


def test_common_protocol_runs_rank_zeros_best_op_that_every_rank_has():
    assert decide(protocol=TPProtocol.COMMON, gathered=[[3, 5, 9], [9, 5, -1], [5, 9, 1]]) == 5
    assert decide(protocol=TPProtocol.COMMON, gathered=[[3, -1], [4, -1]]) is None
    assert decide(protocol=TPProtocol.COMMON, gathered=[[-1, -1], [-1, -1]]) is None


def test_offer_pads_to_the_round_width():
    assert offer(candidates=[_f(0), _f(1), _f(2)], width=2) == [op_id(_f(0)), op_id(_f(1))]
    assert offer(candidates=[], width=3) == [-1, -1, -1]


def test_tp_context_rejects_bad_fields():
    gather, reduce = (lambda ids: [ids]), (lambda t: t)
    with pytest.raises(TypeError, match="protocol"):
        TPContext(rank=0, size=1, all_gather=gather, all_reduce=reduce, protocol="first")
    with pytest.raises(ValueError, match="rank"):
        TPContext(rank=2, size=2, all_gather=gather, all_reduce=reduce)


def _arbiter(policy: str, *, microbatches: int = 4) -> Arbiter:
    layout = Layout(stages=2, chunks=1, microbatches=microbatches, split=policy in ("bfw", "cpw", "zb-h1"))
    pol = make_policy(name=policy, stages=2, chunks=1, microbatches=microbatches)
    return Arbiter(layout=layout, stage=1, policy=pol, cap=Cap.parse("inf"))


@pytest.mark.parametrize("policy", ["1f1b", "ready-1f1b", "bf", "bfw", "cpw"])
def test_candidates_commit_nothing_and_start_matches_next_action(policy):
    """Starting each step's first candidate replays exactly what next_action would have run."""
    picked, started = _arbiter(policy), _arbiter(policy)
    layout = picked.layout
    arrivals = [layout.message_need(a) for a in layout.actions(stage=1) if layout.message_need(a) is not None]
    for arbiter in (picked, started):  # the last stage: every activation in, its backwards need none
        for message in arrivals:
            arbiter.on_arrival(message)
    order_next, order_start = [], []
    while not picked.finished:
        chosen = picked.next_action()
        first = started.candidates(3)
        assert started.candidates(3) == first  # peeking changes nothing
        assert chosen is not None and first[0] == chosen[0]
        assert started.start(first[0]) == chosen[1]
        order_next.append(chosen[0])
        order_start.append(first[0])
        for arbiter in (picked, started):
            arbiter.on_done(chosen[0])
    assert order_next == order_start


def test_bf_candidates_follow_the_pick_order_and_any_can_start():
    arbiter = _arbiter("bf")
    layout = arbiter.layout
    for a in layout.actions(stage=1):
        if a.kind is Kind.F and a.microbatch < 3:
            arbiter.on_arrival(layout.message_need(a))
    first = arbiter.candidates(1)[0]
    arbiter.start(first)
    arbiter.on_done(first)  # its B is now ready, as are forwards 1 and 2
    best = arbiter.candidates(3)
    assert best[0].kind is Kind.B  # BF's backward turn
    assert [a.kind for a in best[1:]] == [Kind.F, Kind.F]
    assert arbiter.start(best[2]) is True  # overtakes forward 1 and the backward
    assert arbiter.candidates(3) == best[:2]


@pytest.mark.parametrize(("protocol", "rounds", "agreed"), [("first", 2, _b(0)), ("common", 1, _f(1))])
def test_rounds_over_threads_agree_even_when_ready_sets_differ(protocol, rounds, agreed):
    """Rank 1 lacks rank 0's best op: `first` needs another round, `common` agrees at once."""
    group = ThreadAllGather(parties=2, timeout_s=5)
    views = [[_b(0), _f(1), _f(2)], [_f(1), _f(2)]]
    chosen: dict[int, list] = {}

    def rank(r: int) -> None:
        tp = TPContext(
            rank=r, size=2, all_gather=group.member(r), all_reduce=lambda x: x, protocol=TPProtocol(protocol), k=3
        )
        agreement = Agreement(tp=tp)
        action = agreement.round(views[r])
        if action is None:  # the late rank caught up before the next round
            action = agreement.round([_b(0), _f(1), _f(2)])
        chosen[r] = [action, agreement.rounds, agreement.disagreements, agreement.conflicts]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert chosen[0] == chosen[1] == [agreed, rounds, rounds - 1, rounds - 1]


def test_a_rank_with_nothing_eligible_is_a_disagreement_but_no_conflict():
    group = ThreadAllGather(parties=2, timeout_s=5)
    results: dict[int, Agreement] = {}

    def rank(r: int) -> None:
        agreement = Agreement(tp=TPContext(rank=r, size=2, all_gather=group.member(r), all_reduce=lambda x: x))
        assert agreement.round([_f(0)] if r == 0 else []) is None
        results[r] = agreement

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [(a.rounds, a.disagreements, a.conflicts) for a in results.values()] == [(1, 1, 0), (1, 1, 0)]


def test_tp_block_needs_heads_and_hidden_width_divisible():
    block = Block(GPTConfig(n_head=6, n_embd=48))
    with pytest.raises(ValueError, match="n_head"):
        TPBlock(block, rank=0, size=4, all_reduce=lambda t: t)
    with pytest.raises(ValueError, match="n_head"):
        TPLayers(layers=lambda: [block], rank=0, size=4, all_reduce=lambda t: t)()
    with pytest.raises(ValueError, match="n_embd"):
        check_tp(n_head=16, n_embd=2, size=16)


def test_a_tp_block_of_one_rank_is_the_block():
    torch.manual_seed(0)
    block = Block(GPTConfig(n_head=4, n_embd=32))
    x = torch.randn(2, 8, 32)
    torch.testing.assert_close(TPBlock(block, rank=0, size=1, all_reduce=lambda t: t)(x), block(x))


class _Slow:
    """A channel whose deliveries come late (one TP rank's receives only)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def recv(self, tensor: torch.Tensor) -> None:
        time.sleep(self.delay_s)
        self.inner.recv(tensor)


class _Traced(GradCapture):
    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.order: list[Action] = []

    def run(self, *, action: Action, **kwargs):
        self.order.append(action)
        return self.inner.run(action=action, **kwargs)


def _tp_pipeline(*, policy_name: str, protocol: str, slow_rank: int | None, tp: int = 2):
    run = RunConfig(
        model=TINY,
        pipeline={"stages": 2, "chunks": 1, "microbatches": 4, "timeout_s": 30},
        train={"micro_batch_size": 2, "seq_len": 16, "iterations": 1},
    )
    policy = run.pipeline.resolved_policy(policy_name)
    layout = replace(run.pipeline.layout, split=policy.split)
    workload = gpt_workload(run)

    def wrap(rank, channel):
        return _Slow(channel, 0.01) if rank == slow_rank else channel

    settings = IterationSettings(tp_protocol=TPProtocol(protocol))
    with LocalBackend.over(layout=layout, timeout_s=30, tp=tp, wrap=wrap, settings=settings) as pipeline:
        executors = [
            _Traced(
                replace(
                    workload,
                    layers=TPLayers(
                        layers=workload.layers, rank=t, size=tp, all_reduce=pipeline.tp_all_reduce(stage=s, rank=t)
                    ),
                ).executor(stage=s, layout=layout)
            )
            for s in range(layout.stages)
            for t in range(tp)
        ]
        report = pipeline.run_iteration(iteration=0, policy=policy, cap=Cap.parse("2x"), executors=executors)
    return run, report, executors


def _assert_tp_gradients(run: RunConfig, executors, *, tp: int) -> None:
    _, layers = gpt_reference(run)
    parts = partition(n_layers=len(layers), parts=run.pipeline.stages)
    for index, executor in enumerate(executors):
        stage, rank = divmod(index, tp)
        expected = []
        for i in parts[stage]:
            grads = {name: p.grad for name, p in layers[i].named_parameters()}
            if isinstance(layers[i], Block):
                grads = shard_block_tensors(grads, n_head=run.model.n_head, rank=rank, size=tp)
            expected += [grads[name] for name, _ in layers[i].named_parameters()]
        assert len(expected) == len(executor.grads)
        for got, want in zip(executor.grads, expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("policy_name", "protocol"), [("1f1b", "first"), ("bf", "first"), ("bf", "common"), ("bfw", "common")]
)
def test_pp2_tp2_gradients_equal_slices_of_the_unsplit_model(policy_name, protocol):
    run, report, executors = _tp_pipeline(policy_name=policy_name, protocol=protocol, slow_rank=None)
    _assert_tp_gradients(run, executors, tp=2)
    assert report.loss == pytest.approx(gpt_reference(run)[0], rel=1e-5)


@pytest.mark.parametrize("protocol", ["first", "common"])
def test_a_late_rank_still_agrees_on_every_op(protocol):
    run, report, executors = _tp_pipeline(policy_name="bf", protocol=protocol, slow_rank=1)
    for stage in range(2):
        assert executors[2 * stage].order == executors[2 * stage + 1].order
        assert len(executors[2 * stage].order) == 8
    assert all(s.tp_rounds >= 8 and s.tp_ms > 0 for s in report.stages)
    _assert_tp_gradients(run, executors, tp=2)


def test_a_fixed_policy_runs_the_same_list_on_every_rank_without_rounds():
    run, report, executors = _tp_pipeline(policy_name="1f1b", protocol="common", slow_rank=1)
    for stage in range(2):
        assert executors[2 * stage].order == executors[2 * stage + 1].order
    assert all(s.tp_rounds == 0 and s.tp_ms == 0 for s in report.stages)
    _assert_tp_gradients(run, executors, tp=2)


def test_replicated_gradients_are_identical_across_ranks():
    """Embeddings, LayerNorms, head and row-parallel biases see the same inputs on every rank."""
    _, _, executors = _tp_pipeline(policy_name="bf", protocol="common", slow_rank=None)
    sharded = ("attn.qkv.", "attn.proj.weight", "mlp.fc.", "mlp.proj.weight")
    for stage in range(2):
        names = [name for name, _ in executors[2 * stage].runner.module(0).named_parameters()]
        assert len(names) == len(executors[2 * stage].grads)
        replicated = [i for i, name in enumerate(names) if not any(part in name for part in sharded)]
        assert any("ln_1" in names[i] for i in replicated)
        for i in replicated:
            torch.testing.assert_close(executors[2 * stage].grads[i], executors[2 * stage + 1].grads[i], rtol=0, atol=0)


def test_tensor_all_reduce_sums_in_rank_order():
    group = ThreadAllGather(parties=3, timeout_s=5)
    out: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        out[r] = tensor_all_reduce(group.member(r))(torch.full((2,), float(r + 1)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(out[r], torch.full((2,), 6.0)) for r in range(3))


def test_gpt_layers_under_tp_keep_embed_and_head():
    model = GPT(GPTConfig(**TINY), seed=0)
    layers = TPLayers(layers=model.layers, rank=1, size=2, all_reduce=lambda t: t)()
    assert layers[0] is model.embed and layers[-1] is model.head
    assert all(isinstance(layer, TPBlock) for layer in layers[1:-1])


def test_bad_tp_arguments_are_rejected():
    with pytest.raises(ValueError, match="tp"):
        LocalBackend.over(layout=Layout(stages=2, chunks=1, microbatches=2, split=False), tp=0)
    with pytest.raises(ValueError, match="k"):
        _arbiter("bf").candidates(0)


def test_the_global_gradient_norm_counts_replicated_parameters_once():
    config = GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8)
    x = torch.randint(0, 256, (2, 8))
    ranks = []
    for rank in range(2):
        layers = TPLayers(layers=GPT(config, seed=0).layers, rank=rank, size=2, all_reduce=lambda t: t)()
        runner = StageRunner(
            chunks={0: nn.Sequential(*layers)},
            first_chunk=0,
            last_chunk=0,
            loss_fn=lm_loss,
            loss_scale=1.0,
            optimizer_factory=lambda params: torch.optim.SGD(params, lr=0.0),
        )
        runner.forward(chunk=0, microbatch=0, inputs=x, targets=x)
        runner.backward(chunk=0, microbatch=0, grad=None)
        ranks.append(runner)
    sharded = sum(float(p.grad.square().sum()) for p in ranks[1].parameters() if not getattr(p, "tp_replica", False))
    replicas = sum(float(p.grad.square().sum()) for p in ranks[1].parameters() if getattr(p, "tp_replica", False))
    assert replicas > 0
    assert ranks[1].grad_sq_norm() == pytest.approx(sharded)
    assert ranks[0].grad_sq_norm() == pytest.approx(sum(float(p.grad.square().sum()) for p in ranks[0].parameters()))
