"""A stage module for PyTorch's pipelining whose passes SLEEP a duration trace's times.

Each op sleeps what :class:`rrfp_ray.sim.variability.Trace` gives it (standing in for GPU kernel
time) and moves a small real tensor. Which microbatch is running is read from the data: column
0 of the activation holds the microbatch index, set in the input batch and passed through
unchanged by every stage, so the sleeps do not depend on the order PyTorch calls the stage in.

The graph of one stage, for output ``y = x' + z``::

    x ---> _InputPath  (forward: sleep F;  backward: sleep B)  --> x' --+
    anchor -^                                                           +--> y
    weight -> _WeightPath (forward: nothing; backward: sleep W) --> z --+

- Full backward (``torch.autograd.backward``, GPipe/1F1B) runs both backward nodes: B + W.
- PyTorch's split backward (zero bubble; ``stage_backward_input`` then ``stage_backward_weight``
  in ``torch/distributed/pipelining/_backward.py``): the input pass asks autograd for the
  gradient of ``x`` only, which runs ``_InputPath``'s backward but not ``_WeightPath``'s; it
  keeps the gradient arriving at the add, where the weight path joins the input path, and the
  weight pass starts from there towards ``weight``, so only ``_WeightPath``'s backward (W) runs.
- ``anchor`` is a leaf that needs a gradient but is no parameter: on the first stage the input
  needs no gradient, and without it ``_InputPath`` would not be in the graph at all. Being no
  parameter, the weight pass never reaches it. Its gradient is None (never accumulated).
- On stage index 0 PyTorch skips the input pass (there is no input gradient to send) and its
  weight pass runs a full backward, so there both sleeps land in the W op: B + W at W's turn.

Communication latency is modelled on the receiving side: PyTorch sends inside the schedule, so
a message's trace latency (``commF`` into this stage, ``commB`` back into it) is slept at the
start of the op that consumes it, on top of the op's own time. Under the V placement the turn
from virtual stage P-1 to P stays on rank P-1 (a local hand-off in PyTorch as here): no latency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from rrfp_ray.schedule.actions import Kind, Placement
from rrfp_ray.schedule.deps import Layout, Message
from rrfp_ray.sim.variability import Trace


@dataclass(frozen=True)
class StageCosts:
    """Seconds each pass of one virtual stage sleeps, per microbatch (latencies included)."""

    forward_s: tuple[float, ...]
    input_grad_s: tuple[float, ...]
    weight_grad_s: tuple[float, ...]


def stage_costs(*, trace: Trace, virtual_stage: int, placement: Placement = Placement.LOOPED) -> StageCosts:
    """What virtual stage ``virtual_stage`` sleeps: F (+ commF in), I (+ commB in) and W."""
    if not 0 <= virtual_stage < trace.virtual_stages:
        raise ValueError(f"virtual_stage {virtual_stage} outside the trace (0..{trace.virtual_stages - 1})")
    layout = Layout(stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches, placement=placement)
    last = trace.virtual_stages - 1

    def cost(kind: Kind, m: int, *, receives: Kind | None) -> float:
        op = trace.duration(layout.action(kind=kind, virtual_stage=virtual_stage, microbatch=m))
        if receives is None:
            return op / 1000
        message = Message(kind=receives, virtual_stage=virtual_stage, microbatch=m)
        return (op + (0.0 if layout.is_local(message) else trace.latency(message))) / 1000

    span = range(trace.microbatches)
    return StageCosts(
        forward_s=tuple(cost(Kind.F, m, receives=Kind.F if virtual_stage > 0 else None) for m in span),
        input_grad_s=tuple(cost(Kind.I, m, receives=Kind.B if virtual_stage < last else None) for m in span),
        weight_grad_s=tuple(cost(Kind.W, m, receives=None) for m in span),
    )


@dataclass(frozen=True)
class _Turn:
    """One microbatch on one virtual stage: what its passes sleep, and the log they note themselves in."""

    virtual_stage: int
    microbatch: int
    costs: StageCosts
    log: list[tuple[str, int, int]]

    def sleep(self, kind: str) -> None:
        self.log.append((kind, self.virtual_stage, self.microbatch))
        seconds = {"F": self.costs.forward_s, "B": self.costs.input_grad_s, "W": self.costs.weight_grad_s}[kind]
        time.sleep(seconds[self.microbatch])


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, turn: _Turn) -> torch.Tensor:
        del anchor
        turn.sleep("F")
        ctx.turn = turn
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.turn.sleep("B")
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, like: torch.Tensor, turn: _Turn) -> torch.Tensor:
        ctx.turn = turn
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.turn.sleep("W")
        return grad.new_zeros(()), None, None


class SleepStage(nn.Module):
    """One virtual stage: returns its input unchanged after sleeping the trace's times.

    Every pass appends ``(kind, virtual_stage, microbatch)`` to ``log`` as it starts: ``F`` for
    the forward, ``B`` and ``W`` for the two backward sleeps (both inside one op when PyTorch
    does not split the backward).
    """

    def __init__(self, *, costs: StageCosts, virtual_stage: int, log: list[tuple[str, int, int]]) -> None:
        super().__init__()
        self.costs = costs
        self.virtual_stage = virtual_stage
        self.log = log
        self.weight = nn.Parameter(torch.zeros(()))
        self.anchor = torch.zeros((), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        turn = _Turn(virtual_stage=self.virtual_stage, microbatch=int(x[0, 0].item()), costs=self.costs, log=self.log)
        return _InputPath.apply(x, self.anchor, turn) + _WeightPath.apply(self.weight, x.detach(), turn)


def microbatch_inputs(*, microbatches: int, payload_elems: int) -> torch.Tensor:
    """The whole batch, one row per microbatch, column 0 holding the microbatch index."""
    batch = torch.zeros(microbatches, payload_elems)
    batch[:, 0] = torch.arange(microbatches, dtype=batch.dtype)
    return batch
