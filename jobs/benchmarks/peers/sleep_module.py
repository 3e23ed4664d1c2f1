"""A stage module for PyTorch's pipelining whose passes SLEEP a duration trace's times.

Each op sleeps what :class:`rrfp_ray.sim.trace.Trace` gives it (standing in for GPU kernel
time) and moves a small real tensor. Which microbatch is running is read from the data: column
0 of the activation holds the microbatch index, set in the input batch and passed through
unchanged by every stage, so the sleeps do not depend on the order PyTorch calls the stage in.

The graph of one stage, for output ``y = x' + z``::

    x ---> _InputPath  (forward: sleep F;  backward: sleep B)  --> x' --+
    anchor -^                                                           +--> y
    weight -> _WeightPath (forward: nothing; backward: sleep W) --> z --+

- Full backward (``torch.autograd.backward``, GPipe/1F1B) runs both backward nodes: B + W (all
  of it in the input path's, see below).
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

Without the split (GPipe, 1F1B, interleaved) the input path sleeps B + W and the weight path
nothing, so that the gradient leaves when the whole backward is done, as in rrfp-ray's B op.

Communication latency is a delivery delay, charged as rrfp-ray's runtime charges it: there the
sender's link thread holds a message its trace latency after the op that made it ends, while
compute goes on. Here every op writes the time it ends into column 1 of what it sends (the
activation, or the gradient of its input), and the op that consumes it first sleeps until that
time plus the message's trace latency (``commF`` into this stage, ``commB`` back into it), then
its own time: PyTorch's sender goes on at once, and the receiver cannot use the message before
it would have been delivered. Under the V placement the turn from virtual stage P-1 to P stays
on rank P-1 (a local hand-off in PyTorch as here): no latency.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from rrfp_ray.runtime.cpu import OpClock
from rrfp_ray.schedule.actions import Kind, Placement
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.sim.trace import Trace

SENT_AT = 1  # the payload column holding the time its sender's op ended (CLOCK_MONOTONIC, s)


@dataclass(frozen=True)
class StageCosts:
    """Seconds each pass of one virtual stage sleeps, per microbatch, and the delivery delay of
    the activation (into F) and of the gradient (into I or B) it receives."""

    forward_s: tuple[float, ...]
    input_grad_s: tuple[float, ...]
    weight_grad_s: tuple[float, ...]
    activation_latency_s: tuple[float, ...]
    gradient_latency_s: tuple[float, ...]


def stage_costs(
    *, trace: Trace, virtual_stage: int, placement: Placement = Placement.LOOPED, split: bool = True
) -> StageCosts:
    """What virtual stage ``virtual_stage`` sleeps: F, I and W (without the `split`: B + W and
    nothing), and the latencies of the messages it receives (none at a local hand-off)."""
    if not 0 <= virtual_stage < trace.virtual_stages:
        raise ValueError(f"virtual_stage {virtual_stage} outside the trace (0..{trace.virtual_stages - 1})")
    layout = Layout(stages=trace.stages, chunks=trace.chunks, microbatches=trace.microbatches, placement=placement)
    last = trace.virtual_stages - 1

    def op(kind: Kind, m: int) -> float:
        return trace.duration(layout.action(kind=kind, virtual_stage=virtual_stage, microbatch=m)) / 1000

    def latency(kind: Kind, m: int, *, receives: bool) -> float:
        message = Message(kind=kind, virtual_stage=virtual_stage, microbatch=m)
        return 0.0 if not receives or layout.is_local(message) else trace.latency(message) / 1000

    span = range(trace.microbatches)
    return StageCosts(
        forward_s=tuple(op(Kind.F, m) for m in span),
        input_grad_s=tuple(op(Kind.I if split else Kind.B, m) for m in span),
        weight_grad_s=tuple(op(Kind.W, m) if split else 0.0 for m in span),
        activation_latency_s=tuple(latency(Kind.F, m, receives=virtual_stage > 0) for m in span),
        gradient_latency_s=tuple(latency(Kind.B, m, receives=virtual_stage < last) for m in span),
    )


def delivery_wait_s(*, sent_at: float, latency_s: float, now: float) -> float:
    """How long a consumer waits for a message sent at `sent_at` to be delivered `latency_s` later."""
    return max(0.0, sent_at + latency_s - now) if sent_at > 0 else 0.0


@dataclass(frozen=True)
class _Turn:
    """One microbatch on one virtual stage: what its passes sleep, and the log they note themselves in."""

    virtual_stage: int
    microbatch: int
    costs: StageCosts
    log: list[tuple[str, int, int]]
    op_clock: OpClock

    def sleep(self, kind: str, *, received: torch.Tensor) -> None:
        """Wait for `received` to be delivered, then sleep the pass's own time."""
        began = OpClock.now()
        self.log.append((kind, self.virtual_stage, self.microbatch))
        m = self.microbatch
        latency = self.costs.activation_latency_s[m] if kind == "F" else self.costs.gradient_latency_s[m]
        now = time.clock_gettime(time.CLOCK_MONOTONIC)
        wait = delivery_wait_s(sent_at=float(received[0, SENT_AT]), latency_s=latency, now=now)
        seconds = {"F": self.costs.forward_s, "B": self.costs.input_grad_s, "W": self.costs.weight_grad_s}[kind]
        time.sleep(wait + seconds[m])
        self.op_clock.add(since=began)


def _stamped(tensor: torch.Tensor, *, turn: _Turn) -> torch.Tensor:
    """A copy of what an op sends, with the time it ends in its SENT_AT column."""
    began = OpClock.now()
    out = tensor.clone()
    out[:, SENT_AT] = time.clock_gettime(time.CLOCK_MONOTONIC)
    turn.op_clock.add(since=began)
    return out


class _InputPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, turn: _Turn) -> torch.Tensor:
        del anchor
        turn.sleep("F", received=x)
        ctx.turn = turn
        return _stamped(x, turn=turn)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.turn.sleep("B", received=grad)
        return _stamped(grad, turn=ctx.turn), None, None


class _WeightPath(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, like: torch.Tensor, turn: _Turn) -> torch.Tensor:
        ctx.turn = turn
        return torch.zeros_like(like)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.turn.sleep("W", received=grad)  # the same gradient as the input path's: waited for at most once
        return grad.new_zeros(()), None, None


class SleepStage(nn.Module):
    """One virtual stage: returns its input unchanged after sleeping the trace's times.

    Every pass appends ``(kind, virtual_stage, microbatch)`` to ``log`` as it starts: ``F`` for
    the forward, ``B`` and ``W`` for the two backward sleeps (both inside one op when PyTorch
    does not split the backward). ``op_clock`` counts the CPU of the passes' own work (the sleeps
    and the copies they send).
    """

    def __init__(
        self, *, costs: StageCosts, virtual_stage: int, log: list[tuple[str, int, int]], op_clock: OpClock | None = None
    ) -> None:
        super().__init__()
        self.costs = costs
        self.virtual_stage = virtual_stage
        self.log = log
        self.op_clock = op_clock or OpClock()
        self.weight = nn.Parameter(torch.zeros(()))
        self.anchor = torch.zeros((), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        turn = _Turn(
            virtual_stage=self.virtual_stage,
            microbatch=int(x[0, 0].item()),
            costs=self.costs,
            log=self.log,
            op_clock=self.op_clock,
        )
        return _InputPath.apply(x, self.anchor, turn) + _WeightPath.apply(self.weight, x.detach(), turn)


def microbatch_inputs(*, microbatches: int, payload_elems: int) -> torch.Tensor:
    """The whole batch, one row per microbatch, column 0 holding the microbatch index (float64, so
    that the SENT_AT column holds a monotonic time to the microsecond)."""
    if payload_elems <= SENT_AT:
        raise ValueError(f"payload_elems must be > {SENT_AT} (the microbatch and its send time), got {payload_elems}")
    batch = torch.zeros(microbatches, payload_elems, dtype=torch.float64)
    batch[:, 0] = torch.arange(microbatches, dtype=batch.dtype)
    return batch
