"""One pipeline stage's share of a model: its chunks, their saved state, its optimizer.

A ``StageRunner`` runs forward, backward, and the split backward (input pass, then a
deferred weight pass) for any (chunk, microbatch), in whatever order its caller's
arbiter picks. It knows nothing about transports or threads.
The split itself is `rrfp_ray.train.split_backward`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from rrfp_ray.runtime.measure import LayerWatch, stamp
from rrfp_ray.runtime.tree import Tree, flatten, tree_map
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.train.boundary import as_input, differentiable, grad_message, to_send
from rrfp_ray.train.partition import stage_chunks
from rrfp_ray.train.precision import Precision, autocast, for_the_wire
from rrfp_ray.train.split_backward import WeightPass, note_storages, noting, split_backward, unchanged

LossFn = Callable[[Any, Any], Tensor | tuple[Tensor, Tensor]]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def build_stage(
    *,
    layers: Sequence[nn.Module],
    stages: int,
    chunks: int,
    stage: int,
    loss_fn: LossFn,
    loss_scale: float,
    optimizer_factory: OptimizerFactory,
    placement: Placement = Placement.LOOPED,
    precision: Precision = Precision.FP32,
    device: str = "cpu",
    sizes: Sequence[int] | None = None,
) -> StageRunner:
    """A runner for ``stage`` of a ``stages`` x ``chunks`` pipeline over ``layers`` (``sizes``: layers per
    virtual stage, default even)."""
    last_stage, last_chunk = placement.locate(virtual_stage=stages * chunks - 1, stages=stages)
    return StageRunner(
        chunks=stage_chunks(layers=layers, stages=stages, chunks=chunks, stage=stage, placement=placement, sizes=sizes),
        first_chunk=0 if stage == 0 else None,
        last_chunk=last_chunk if stage == last_stage else None,
        loss_fn=loss_fn,
        loss_scale=loss_scale,
        optimizer_factory=optimizer_factory,
        precision=precision,
        device=device,
    )


@dataclass
class _Saved:
    inputs: list[Tensor]  # the received leaves that carry a gradient back (none on virtual stage 0)
    roots: list[Tensor]  # the output's differentiable leaves, or the scaled loss on the last virtual stage
    nbytes: int
    watch: LayerWatch | None = None  # this microbatch's layers are being measured


@dataclass
class _Deferred:
    passes: list[WeightPass]
    nbytes: int
    watch: LayerWatch | None = None


class StageRunner:
    """Forward and backward work of one pipeline stage; keyed by (chunk, microbatch).

    ``first_chunk``/``last_chunk``: the chunk holding virtual stage 0 / the last virtual
    stage, or None when this stage holds neither. ``loss_scale`` multiplies each
    microbatch's loss (1/M makes the summed gradients those of the mean loss).
    """

    def __init__(
        self,
        *,
        chunks: dict[int, nn.Module],
        first_chunk: int | None,
        last_chunk: int | None,
        loss_fn: LossFn,
        loss_scale: float,
        optimizer_factory: OptimizerFactory,
        precision: Precision = Precision.FP32,
        device: str = "cpu",
    ) -> None:
        if not chunks:
            raise ValueError("chunks must hold at least one chunk")
        for name, value in (("first_chunk", first_chunk), ("last_chunk", last_chunk)):
            if value is not None and value not in chunks:
                raise ValueError(f"{name} {value} is not one of the chunks {sorted(chunks)}")
        if not loss_scale > 0:
            raise ValueError(f"loss_scale must be > 0, got {loss_scale}")
        self._chunks = dict(chunks)
        self._first = first_chunk
        self._last = last_chunk
        self._loss_fn = loss_fn
        self._loss_scale = loss_scale
        self.precision = precision
        self._device = device
        self._chunk_params = {c: [p for p in m.parameters() if p.requires_grad] for c, m in self._chunks.items()}
        self._optimizer = optimizer_factory(self.parameters())
        self._saved: dict[tuple[int, int], _Saved] = {}
        self._deferred: dict[tuple[int, int], _Deferred] = {}
        self._losses: dict[int, tuple[Tensor, float | None]] = {}  # microbatch: (loss or sum, count)
        self._peak = 0
        self._kept: dict[tuple[int, int], int] = {}  # (chunk, microbatch): what its forward kept, this iteration

    def parameters(self) -> list[nn.Parameter]:
        unique = {id(p): p for c in sorted(self._chunk_params) for p in self._chunk_params[c]}
        return list(unique.values())  # a parameter two chunks of this stage share is stepped once

    def forward(
        self,
        *,
        chunk: int,
        microbatch: int,
        inputs: Tree,
        targets: Tree | None = None,
        watch: LayerWatch | None = None,
    ) -> Tree | None:
        """Run the chunk; return the activations to send, or None on the last virtual stage.

        Inputs and outputs are trees of tensors (`rrfp_ray.runtime.tree`). A received leaf
        that requires grad gets its gradient sent back; a sent leaf requires grad when
        the chunk's output depends on it differentiably. With `watch`, this microbatch's work
        through each layer, forward and backward, is stamped into it (the same work, layer by layer)."""
        module = self.module(chunk)
        key = (chunk, microbatch)
        if key in self._saved or key in self._deferred:
            raise RuntimeError(f"forward of chunk {chunk} microbatch {microbatch} ran again before its backward")
        last = chunk == self._last
        if last and targets is None:
            raise ValueError(f"targets are required on the last virtual stage (chunk {chunk})")
        if not last and targets is not None:
            raise ValueError(f"targets only apply to the last virtual stage, not chunk {chunk}")
        x = inputs if chunk == self._first else tree_map(as_input, inputs)
        saved: dict[int, int] = {}
        with torch.enable_grad(), saved_tensors_hooks(note_storages(saved), unchanged):
            with autocast(self.precision, device=self._device):
                out = (
                    module(x) if watch is None else self._watched_forward(module=module, x=x, saved=saved, watch=watch)
                )
                if targets is not None:
                    roots = [self._scaled_loss(out=out, targets=targets, microbatch=microbatch)]
            if targets is None:
                out = tree_map(lambda t: for_the_wire(self.precision, t), out)
                roots = differentiable(out)
        received = [] if chunk == self._first else [t for t in flatten(x)[0] if t.requires_grad]
        nbytes = self._activation_bytes(saved | _storages(roots))
        self._saved[key] = _Saved(inputs=received, roots=roots, nbytes=nbytes, watch=watch)
        self._kept[key] = nbytes
        self._peak = max(self._peak, self.held_bytes())
        return None if last else tree_map(to_send, out)

    def backward(self, *, chunk: int, microbatch: int, grad: Tree | None) -> Tree | None:
        """Input and weight gradients at once; return the input gradients (None on virtual stage 0)."""
        saved = self._pop_saved(chunk=chunk, microbatch=microbatch)
        grads = self._root_grads(chunk=chunk, roots=saved.roots, grad=grad)
        if saved.watch is not None:
            saved.watch.begin_pass()
        if saved.roots:
            torch.autograd.backward(saved.roots, grads)
        if saved.watch is not None:
            saved.watch.end_pass()
        if chunk == self._first:
            return None
        return grad_message([x.grad if x.grad is not None else torch.zeros_like(x) for x in saved.inputs])

    def backward_input(self, *, chunk: int, microbatch: int, grad: Tree | None) -> Tree | None:
        """Input gradients only; the weight gradients wait for ``backward_weight``.

        On virtual stage 0 there is no input gradient, so all the work waits.
        """
        saved = self._pop_saved(chunk=chunk, microbatch=microbatch)
        grads = self._root_grads(chunk=chunk, roots=saved.roots, grad=grad)
        if saved.watch is not None:
            saved.watch.begin_pass()
        if not saved.inputs or not saved.roots:
            dx = None if chunk == self._first else grad_message([torch.zeros_like(x) for x in saved.inputs])
            edges = [get_gradient_edge(root) for root in saved.roots]
            params = self._chunk_params[chunk]
            passes = [WeightPass(roots=edges, grads=grads, params=params, pinned={})] if edges else []
        else:
            dx, passes = split_backward(
                roots=saved.roots, grads=grads, leaves=saved.inputs, params=self._chunk_params[chunk]
            )
            dx = grad_message(dx)
        if saved.watch is not None:
            saved.watch.end_pass()
        held = saved.nbytes + self._activation_bytes(_storages(g for work in passes for g in work.grads))
        self._deferred[(chunk, microbatch)] = _Deferred(passes=passes, nbytes=held, watch=saved.watch)
        self._peak = max(self._peak, self.held_bytes())
        return dx

    def backward_weight(self, *, chunk: int, microbatch: int) -> None:
        """Accumulate the weight gradients ``backward_input`` left, then free the microbatch."""
        deferred = self._deferred.pop((chunk, microbatch), None)
        if deferred is None:
            raise RuntimeError(
                f"no weight pass pending for chunk {chunk} microbatch {microbatch}: backward_input has not run"
            )
        watch = deferred.watch
        owner = {} if watch is None else self._layer_of_params(chunk)
        for work in deferred.passes:
            if watch is not None:
                watch.begin_pass()
            work.run()
            if watch is not None:
                watch.end_pass(owner=owner.get(id(work.params[0])) if work.params else None)

    def _watched_forward(self, *, module: nn.Module, x: Tree, saved: dict[int, int], watch: LayerWatch) -> Tree:
        """`module`'s layers run one by one, as `nn.Sequential` does, each stamped, with what it saved for its
        backward (noted in `saved` too, for the chunk), and a hook on each boundary for the backward's stamps."""
        layers = list(module)
        for j, layer in enumerate(layers):
            own: dict[int, int] = {}
            both = noting(note_storages(saved), note_storages(own))
            with saved_tensors_hooks(both, unchanged):
                start = stamp(self._device)
                x = layer(x)
                watch.forward.append((start, stamp(self._device)))
            watch.activation_bytes.append(self._activation_bytes(own))
            watch.param_bytes.append(sum(p.numel() * p.element_size() for p in layer.parameters()))
            if j < len(layers) - 1:
                for t in differentiable(x):
                    t.register_hook(watch.boundary_hook(j))
        return x

    def _layer_of_params(self, chunk: int) -> dict[int, int]:
        """id of each parameter of `chunk` -> the offset of its layer in the chunk."""
        return {id(p): j for j, layer in enumerate(self.module(chunk)) for p in layer.parameters()}

    def losses(self) -> list[float]:
        """This iteration's unscaled losses, by microbatch (last virtual stage only); sums for a (sum, count) loss."""
        return [float(self._losses[m][0]) for m in sorted(self._losses)]

    def loss_count(self) -> float:
        """How many elements this iteration's (sum, count) losses counted (0 off the last virtual stage)."""
        return sum(count or 0.0 for _, count in self._losses.values())

    def held_bytes(self) -> int:
        """Bytes of activations (and, after an input pass, gradients) held for backward work."""
        return sum(s.nbytes for s in self._saved.values()) + sum(d.nbytes for d in self._deferred.values())

    @property
    def peak_held_bytes(self) -> int:
        """The most ``held_bytes`` reached since the last ``reset_iteration``."""
        return self._peak

    @property
    def kept_bytes(self) -> dict[tuple[int, int], int]:
        """Per (chunk, microbatch) run since the last ``reset_iteration``, the activation bytes its forward kept."""
        return dict(self._kept)

    def reset_iteration(self) -> None:
        """Start an iteration afresh: drop losses, any unfinished work, gradients and the peak."""
        self._saved.clear()
        self._kept.clear()
        self._deferred.clear()
        self._losses.clear()
        self._clear_grads()
        self._peak = 0

    def grad_sq_norm(self, *, exclude: frozenset[int] = frozenset()) -> float:
        """Sum of squared gradient entries over this runner's parameters, less tensor-parallel
        replicas (parameters with a true `tp_replica` attribute; rank 0 counts them) and the
        parameters whose ids are in `exclude` (copies another stage counts)."""
        grads = [
            p.grad
            for p in self.parameters()
            if p.grad is not None and not getattr(p, "tp_replica", False) and id(p) not in exclude
        ]
        squares = [grad.detach().double().square().sum() for grad in grads]
        return float(torch.stack(squares).sum()) if squares else 0.0

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """`chunk`'s trainable parameters, in order."""
        self.module(chunk)
        return list(self._chunk_params[chunk])

    def step(self, *, clip_coef: float, lr: float | None) -> None:
        """Scale gradients by ``clip_coef``, take an optimizer step at ``lr`` (None: the optimizer's own rates),
        clear gradients."""
        self._check_finished()
        if not (math.isfinite(clip_coef) and clip_coef >= 0):
            raise ValueError(f"clip_coef must be finite and >= 0, got {clip_coef}")
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr must be finite and >= 0, got {lr}")
        if clip_coef != 1.0:
            with torch.no_grad():
                for grad in self._grads():
                    grad.mul_(clip_coef)
        for group in self._optimizer.param_groups if lr is not None else []:
            group["lr"] = lr
        self._optimizer.step()
        self._clear_grads()

    def skip_step(self) -> None:
        """Drop this iteration's gradients without stepping (they were not finite)."""
        self._check_finished()
        self._optimizer.zero_grad(set_to_none=True)

    def _check_finished(self) -> None:
        if self._saved or self._deferred:
            unfinished = sorted([*self._saved, *self._deferred])
            raise RuntimeError(f"optimizer step with backward work unfinished for (chunk, microbatch) {unfinished}")

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the parameters this runner steps (with ZeRO-1, this replica's share)."""
        return self._optimizer

    def state_dict(self) -> dict[str, Any]:
        return {
            "chunks": {c: m.state_dict() for c, m in self._chunks.items()},
            "optimizer": self._optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if sorted(state["chunks"]) != sorted(self._chunks):
            raise ValueError(f"state holds chunks {sorted(state['chunks'])}, this runner {sorted(self._chunks)}")
        for c, module in self._chunks.items():
            module.load_state_dict(state["chunks"][c])
        self._optimizer.load_state_dict(state["optimizer"])

    def module(self, chunk: int) -> nn.Module:
        if chunk not in self._chunks:
            raise ValueError(f"chunk {chunk} is not on this stage (chunks {sorted(self._chunks)})")
        return self._chunks[chunk]

    @property
    def optim_bytes(self) -> int:
        """Bytes of optimizer state held (Adam's moments; with ZeRO-1 only the parameters this replica steps)."""
        return sum(
            t.numel() * t.element_size()
            for state in self._optimizer.state.values()
            for t in state.values()
            if isinstance(t, Tensor)
        )

    def _clear_grads(self) -> None:
        """Every parameter's gradient dropped (the optimizer's zero_grad would miss those it does not step: ZeRO-1)."""
        for p in self.parameters():
            p.grad = None

    def _grads(self) -> list[Tensor]:
        return [p.grad for p in self.parameters() if p.grad is not None]

    def _scaled_loss(self, *, out: Tree, targets: Tree, microbatch: int) -> Tensor:
        loss = self._loss_fn(out, targets)
        if isinstance(loss, tuple):  # (sum, count): scaled at the step, by the iteration's global count
            total, count = loss
            self._losses[microbatch] = (total.detach(), float(count))
            return total
        if loss.dim() != 0:
            raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
        self._losses[microbatch] = (loss.detach(), None)
        return loss * self._loss_scale

    def _pop_saved(self, *, chunk: int, microbatch: int) -> _Saved:
        self.module(chunk)
        saved = self._saved.pop((chunk, microbatch), None)
        if saved is None:
            raise RuntimeError(
                f"no saved forward for chunk {chunk} microbatch {microbatch}: "
                "backward before forward, or backward ran twice"
            )
        return saved

    def _root_grads(self, *, chunk: int, roots: list[Tensor], grad: Tree | None) -> list[Tensor]:
        if chunk == self._last:
            if grad is not None:
                raise ValueError(f"grad must be None on the last virtual stage (chunk {chunk}): it starts at the loss")
            return [torch.ones_like(root) for root in roots]
        grads = [] if grad is None else flatten(grad)[0]
        shapes = [tuple(r.shape) for r in roots]
        if grad is None or [tuple(g.shape) for g in grads] != shapes:
            got = None if grad is None else [tuple(g.shape) for g in grads]
            raise ValueError(f"grad for chunk {chunk} must be one tensor per differentiable output {shapes}, got {got}")
        return [g.to(r.dtype) for g, r in zip(grads, roots)]

    def _activation_bytes(self, storages: dict[int, int]) -> int:
        """The bytes of `storages` (data pointer: bytes) that are not a parameter's."""
        params = {p.untyped_storage().data_ptr() for p in self.parameters()}
        return sum(size for ptr, size in storages.items() if ptr not in params)


def _storages(tensors: Iterable[Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
