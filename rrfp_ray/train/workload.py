"""Real training through the pipeline: any model given as a list of modules.

`ModelWorkload` is plain data sent to every stage; each stage builds the whole module
list from the same seed, keeps its own chunks, and returns a `ModelExecutor` that the
runtime drives action by action. Stage 0 reads its inputs and the stage holding the last
virtual stage (`Layout.loss_stage`: the last stage when looped, stage 0 under V) its
targets from the data source by (iteration, microbatch): no data passes through the
driver. After every action of an iteration, the stages agree on the global gradient
norm (one all-reduce over all stages), clip, and step.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from rrfp_ray.models.tp import TPLayers
from rrfp_ray.plan.packing import Packing
from rrfp_ray.runtime.executor import StepResult
from rrfp_ray.runtime.iteration import IterationArgs
from rrfp_ray.runtime.measure import Clock, Costs, LayerWatch, Throttle, stamp
from rrfp_ray.runtime.reduce import ChunkGradients, GradSink, gather_owned, owners
from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.grad_ready import reduce_order
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.sim.trace import Trace, of_iteration
from rrfp_ray.train.boundary import on_device
from rrfp_ray.train.checkpoint import Manifest, StageFile, save_stage
from rrfp_ray.train.layers import ModelLayers
from rrfp_ray.train.optim import Optim, OptimSpec, clip_coef
from rrfp_ray.train.partition import partition
from rrfp_ray.train.precision import Precision, autocast
from rrfp_ray.train.recompute import checkpoint_blocks
from rrfp_ray.train.release import GradRelease
from rrfp_ray.train.runner import LossFn, StageRunner, build_stage
from rrfp_ray.train.sources import DataSource
from rrfp_ray.train.state import Layers, held_names, load_state, stage_state
from rrfp_ray.train.ties import Tie, TiedGradients, TieReduce

logger = logging.getLogger(__name__)


_GATHER_BUCKET_BYTES = 25 * 2**20  # ZeRO-1: bytes per all-gather of the stepped parameters


@dataclass(frozen=True)
class ModelWorkload:
    layers: Callable[[], Sequence[nn.Module]]  # deterministic: every process builds the same weights
    loss_fn: LossFn
    data: DataSource
    microbatches: int
    optim: OptimSpec = field(default_factory=Optim)
    # extra delays (ms) per action and message, to inject variability: iteration k's ops sleep, and its messages
    # wait, injected[k % count] (empty: none)
    injected: tuple[Trace, ...] = ()
    val_data: DataSource | None = None
    device: str = "cpu"  # where each stage computes; payloads move to and from each link's own device
    dp: int = 1  # data-parallel replicas: `data` holds dp x microbatches microbatches an iteration
    dp_rank: int = 0  # this replica: it reads microbatches dp_rank x microbatches onwards
    zero_sum: Callable[[Tensor], Tensor] | None = None  # ZeRO-1: the DP group's sum (set by with_dp)
    counted_loss: bool = False  # loss_fn returns (sum, count): the iteration's loss is the global sum / global count
    ties: tuple[Tie, ...] = ()  # parameters shared between stages (the dry run finds them)
    tie_reduce: TieReduce | None = None  # given by the backend: sums a tensor over the stages of a tie
    tp_rank: int = 0
    precision: Precision = Precision.FP32
    activation_checkpointing: bool = False  # recompute each block's internals in its backward
    layer_split: tuple[int, ...] | None = None  # layers per virtual stage; None: even
    slow_devices: dict[int, float] = field(default_factory=dict)  # stage -> how many times slower it computes

    def layer_ranges(self, *, layout: Layout, n_layers: int) -> list[range]:
        """The layers of each virtual stage, by index into the model's layer list."""
        return partition(n_layers=n_layers, parts=layout.virtual_stages, sizes=self.layer_split)

    def executor(self, *, stage: int, layout: Layout) -> ModelExecutor:
        split = {"stages": layout.stages, "chunks": layout.chunks, "stage": stage, "placement": layout.placement}
        if isinstance(self.layers, ModelLayers):
            layers = self.layers.stage_layers(**split, sizes=self.layer_split)
        else:
            layers = list(self.layers())
        parts = self.layer_ranges(layout=layout, n_layers=len(layers))
        own = {i for c in range(layout.chunks) for i in parts[layout.virtual_stage(stage=stage, chunk=c)]}
        layers = [layer.to(self.device) if i in own else layer for i, layer in enumerate(layers)]  # the rest is dropped
        if self.activation_checkpointing:
            checkpoint_blocks(layers)
        tied = TiedGradients(
            stage=stage,
            stages=layout.stages,
            chunks=layout.chunks,
            placement=layout.placement,
            layers=layers,
            ties=self.ties,
            reduce=self.tie_reduce,
            sizes=self.layer_split,
        )
        runner = build_stage(
            layers=layers,
            stages=layout.stages,
            chunks=layout.chunks,
            placement=layout.placement,
            stage=stage,
            loss_fn=self.loss_fn,
            loss_scale=1.0 if self.counted_loss else 1.0 / (self.microbatches * self.dp),  # summed over the replicas
            optimizer_factory=self.optim.optimizer if self.zero_sum is None else self._shard_optimizer,
            precision=self.precision,
            device=self.device,
            sizes=self.layer_split,
        )
        held = {i: layers[i] for i in sorted(own)}
        first = {c: parts[layout.virtual_stage(stage=stage, chunk=c)].start for c in range(layout.chunks)}
        return ModelExecutor(
            stage=stage, runner=runner, layout=layout, workload=self, tied=tied, layers=held, first_layers=first
        )

    def latency(self, message: Message, *, iteration: int) -> float:
        trace = of_iteration(self.injected, iteration)
        return 0.0 if trace is None else trace.latency(message)

    def with_tp(self, *, rank: int, size: int, all_reduce: Callable[[Tensor], Tensor]) -> ModelWorkload:
        """The GPT's blocks split Megatron-style over `size` ranks (other models: ValueError at build)."""
        return replace(
            self, layers=TPLayers(layers=self.layers, rank=rank, size=size, all_reduce=all_reduce), tp_rank=rank
        )

    def with_ties(self, *, reduce: TieReduce) -> ModelWorkload:
        """This workload as a stage runs it, summing tied gradients over `reduce` (owning stages, tensor) -> sum."""
        return replace(self, tie_reduce=reduce)

    def with_dp(self, *, rank: int, zero_sum: Callable[[Tensor], Tensor] | None = None) -> ModelWorkload:
        if not 0 <= rank < self.dp:
            raise ValueError(f"dp rank must be in [0, {self.dp}), got {rank}")
        return replace(self, dp_rank=rank, zero_sum=zero_sum)

    def _shard_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """ZeRO-1: the optimizer over the parameters this replica owns (`owners`)."""
        owned = [p for p, o in zip(params, owners([p.numel() for p in params], replicas=self.dp)) if o == self.dp_rank]
        if not owned:
            raise ValueError(
                f"ZeRO-1: {len(params)} parameters on a stage are too few to shard over {self.dp} replicas"
            )
        return self.optim.optimizer(owned)


class ModelExecutor:
    """Runs a stage's actions on its `StageRunner`; `layers`: its layers by index into the model's layer
    list; `first_layers`: each chunk's first model layer index.
    On a stage of `ModelWorkload.slow_devices` everything it computes is throttled (`Throttle`):
    its ops, its layers' measurement and its probe."""

    def __init__(
        self,
        *,
        stage: int,
        runner: StageRunner,
        layout: Layout,
        workload: ModelWorkload,
        tied: TiedGradients,
        layers: Layers,
        first_layers: dict[int, int],
    ) -> None:
        self.stage = stage
        self._layers = layers  # this stage's layers, by index into the model's layer list
        self._first_layers = first_layers
        self._throttle = Throttle(factor=workload.slow_devices.get(stage, 1.0), device=workload.device)
        self._watches: dict[int, tuple[int, LayerWatch]] | None = None  # measuring: chunk -> (microbatch, its watch)
        self._tied = tied
        self.runner = runner
        self._layout = layout
        self._order: tuple[int, ...] | None = None  # begin sets it: the data microbatch of each slot
        self._packing: Packing | None = None  # begin sets it: the samples of each data microbatch (None: the data's)
        self._injected: Trace | None = None  # begin sets it: the iteration's injected trace
        self._workload = workload
        # a parameter two chunks of this stage share is final once both are: it goes with the one reduced last
        reduced_with = {id(p): c for c in reduce_order(chunks=layout.chunks) for p in runner.chunk_parameters(c)}
        # what data parallelism sums of each chunk, the last parameter first (about the order a backward finalizes them)
        self._reduced = {
            c: [p for p in reversed(runner.chunk_parameters(c)) if reduced_with[id(p)] == c]
            for c in range(layout.chunks)
        }
        params = runner.parameters()
        sizes = [p.numel() for p in params]
        # ZeRO-1: the replica that steps each parameter (as _shard_optimizer chose), by id
        self._owner = (
            {} if workload.zero_sum is None else dict(zip(map(id, params), owners(sizes, replicas=workload.dp)))
        )

    def begin(self, *, args: IterationArgs) -> None:
        self._injected = of_iteration(self._workload.injected, args.iteration)
        self._order = args.order
        self._packing = args.packing
        self._watches = {} if args.measure else None
        self.runner.reset_iteration()

    def run(
        self, *, action: Action, iteration: int, payload: Tensor | None, release: GradSink | None = None
    ) -> Tensor | None:
        if release is None:
            return self._run(action=action, iteration=iteration, payload=payload)
        with GradRelease(params=self._reduced[action.chunk], release=lambda params: release(self._gradients(params))):
            return self._run(action=action, iteration=iteration, payload=payload)

    def _run(self, *, action: Action, iteration: int, payload: Tensor | None) -> Tensor | None:
        vs = self._layout.vs(action)
        m, c = action.microbatch, action.chunk
        payload = on_device(payload, device=self._workload.device)
        if action.kind is Kind.F:
            inputs, targets = payload, None
            if vs == 0 or vs == self._layout.virtual_stages - 1:
                data_m = m if self._order is None else self._order[m]
                index = self._workload.dp_rank * self._workload.microbatches + data_m
                data = self._workload.data
                if self._packing is None:
                    batch = data.microbatch(iteration=iteration, index=index)
                else:
                    batch = data.samples(iteration=iteration, indexes=self._packing[index])
                x, y = on_device(batch, device=self._workload.device)
                inputs = x if vs == 0 else inputs
                targets = y if vs == self._layout.virtual_stages - 1 else None
            watch = self._watch(chunk=c, microbatch=m, first=True)
            op = partial(self.runner.forward, chunk=c, microbatch=m, inputs=inputs, targets=targets, watch=watch)
        elif action.kind is Kind.I:
            op = partial(self.runner.backward_input, chunk=c, microbatch=m, grad=payload)
        elif action.kind is Kind.B:
            op = partial(self.runner.backward, chunk=c, microbatch=m, grad=payload)
        else:
            op = partial(self.runner.backward_weight, chunk=c, microbatch=m)
        watch = self._watch(chunk=c, microbatch=m)
        start = None if watch is None else stamp(self._workload.device)
        out = self._throttle.run(op)
        if watch is not None:
            watch.op(forward=action.kind is Kind.F, start=start, end=stamp(self._workload.device))
        self._inject(action)
        return out

    def _watch(self, *, chunk: int, microbatch: int, first: bool = False) -> LayerWatch | None:
        """The watch over `microbatch`'s work in `chunk` when it is the one measured (`first`: a forward,
        which starts one for the chunk's first microbatch to run); else None."""
        if self._watches is None:
            return None
        if first and chunk not in self._watches:
            layers = len(self.runner.module(chunk))
            self._watches[chunk] = (
                microbatch,
                LayerWatch(device=self._workload.device, layers=layers, first_layer=self._first_layers[chunk]),
            )
        watched, watch = self._watches.get(chunk, (None, None))
        return watch if watched == microbatch else None

    def measure(self) -> Costs:
        """Each layer's cost as the iteration's own work on its chunk's first microbatch measured it
        (`LayerWatch`), and the probe on this device, throttled as its ops are."""
        if self._watches is None:
            raise RuntimeError(f"stage {self.stage}: measure after an iteration begun without measure")
        if self._workload.device.startswith("cuda"):
            torch.cuda.synchronize()
        layers = [cost for _, watch in self._watches.values() for cost in watch.costs()]
        self._watches = None
        probe = Clock(device=self._workload.device, throttle=self._throttle).probe_ms()
        return Costs(layers=sorted(layers, key=lambda cost: cost.layer), probe_ms=probe)

    def _inject(self, action: Action) -> None:
        """Sleep the injected trace's time of `action`'s data microbatch (a trace's rows are data microbatches)."""
        if self._injected is not None:
            data = action if self._order is None else replace(action, microbatch=self._order[action.microbatch])
            time.sleep(self._injected.duration(data) / 1e3)

    def gradients(self, *, chunk: int) -> ChunkGradients:
        return self._gradients(self._reduced[chunk])

    def _gradients(self, params: list[nn.Parameter]) -> ChunkGradients:
        """The gradients of `params` that exist. With ZeRO-1 each gradient's sum goes to its owner alone, but a
        tied one's to every replica: it is summed over its stages afterwards, and another stage's copy may have another
        owner."""
        params = [p for p in params if p.grad is not None]
        owner = None
        if self._owner:
            owner = [None if id(p) in self._tied.ids else self._owner[id(p)] for p in params]
        return ChunkGradients(tensors=[p.grad for p in params], owners=owner)

    def finish(self, *, iteration: int, all_reduce: Callable[[float], float]) -> StepResult:
        """Sum tied gradients over their stages, clip by the global gradient norm (summed over all
        stages; replica 0's alone, since the replicas hold the same summed gradients, or with ZeRO-1
        each replica's over the parameters it owns, the only sums it holds), step.

        With a (sum, count) loss the gradients are those of the sums: more all-reduces give the
        iteration's count and summed loss over every replica, and dividing by the count makes them
        the global mean's. A norm that is inf or NaN is the same on every stage (it is all-reduced),
        so every stage skips the step on its own and the decision is still one global one."""
        self._tied.all_reduce()
        scale, count, summed = 1.0, None, None
        if self._workload.counted_loss:
            first = self._workload.tp_rank == 0
            count = all_reduce(self.runner.loss_count() if first else 0.0)
            summed = all_reduce(sum(self.runner.losses()) if first else 0.0)
            scale = 1.0 / count if count > 0 else 0.0
        rank = self._workload.dp_rank
        others = frozenset(i for i, o in self._owner.items() if o != rank)
        mine = self.runner.grad_sq_norm(exclude=frozenset(self._tied.duplicates) | others)
        total = all_reduce(mine if self._owner or rank == 0 else 0.0) * scale**2
        lr = self._workload.optim.lr_at(iteration)
        skipped = not math.isfinite(total)
        if skipped:
            if self.stage == 0:
                logger.warning(
                    "iteration %d: gradient norm is %s; every stage skips this optimizer step", iteration, total
                )
            self.runner.skip_step()
        else:
            coef = clip_coef(total_sq_norm=total, max_norm=self._workload.optim.max_grad_norm)
            self.runner.step(clip_coef=coef * scale, lr=lr)
            if self._workload.zero_sum is not None:
                params = self.runner.parameters()
                gather_owned(
                    params,
                    owner=[self._owner[id(p)] for p in params],
                    rank=rank,
                    all_reduce=self._workload.zero_sum,
                    bucket_bytes=_GATHER_BUCKET_BYTES,
                )
        losses = self.runner.losses()
        loss = None
        if losses:
            loss = summed * scale if count is not None else sum(losses) / len(losses)
        return StepResult(
            loss=loss,
            grad_norm=total**0.5,
            lr=lr,
            peak_bytes=self.runner.peak_held_bytes,
            kept=tuple((c, m, n) for (c, m), n in sorted(self.runner.kept_bytes.items())),
            optim_bytes=self.runner.optim_bytes,
            skipped=skipped,
        )

    def chunk_states(self) -> dict[int, dict[str, Tensor]]:
        """This stage's (TP shard's) chunks' weights, on the CPU."""
        return {
            c: {k: v.detach().to("cpu", copy=True) for k, v in s.items()}
            for c, s in self.runner.state_dict()["chunks"].items()
        }

    def save(self, *, directory: Path, iteration: int, shard: int) -> StageFile:
        """Write this stage's (TP shard's) weights and optimizer state by parameter name, atomically (a replica
        other than 0 writes only the optimizer state it steps: ZeRO-1); the driver commits the manifest."""
        rank = self._workload.tp_rank
        state = stage_state(
            layers=self._layers, optimizer=self.runner.optimizer, tp_rank=rank, weights=self._workload.dp_rank == 0
        )
        file = save_stage(directory=directory, iteration=iteration, stage=shard, state=state)
        weights, optimizer = held_names(state)
        return replace(file, tp_rank=rank, weights=weights, optimizer=optimizer)

    def load(self, *, directory: Path, manifest: Manifest) -> None:
        """Take the weights of this stage's layers and the optimizer state of the parameters it steps from
        whichever of `manifest`'s files hold them, whatever pipeline shape wrote them."""
        size = self._workload.layers.size if isinstance(self._workload.layers, TPLayers) else 1
        read = load_state(
            directory=directory,
            manifest=manifest,
            layers=self._layers,
            optimizer=self.runner.optimizer,
            tp_rank=self._workload.tp_rank,
            tp_size=size,
        )
        logger.debug("stage %d: %d of %d checkpoint files read", self.stage, read, len(manifest.files))

    @torch.no_grad()
    def evaluate(self, *, chunk: int, inputs: Tensor | None, index: int) -> Tensor:
        """Forward only on validation microbatch `index`: the activation, or the loss on the last virtual stage."""
        if self._workload.val_data is None:
            raise ValueError("this workload has no validation data (val_data)")
        vs = self._layout.virtual_stage(stage=self.stage, chunk=chunk)
        x, y = on_device(self._workload.val_data.microbatch(iteration=0, index=index), device=self._workload.device)
        with autocast(self._workload.precision, device=self._workload.device):
            out = self.runner.module(chunk)(x if vs == 0 else on_device(inputs, device=self._workload.device))
            loss = self._workload.loss_fn(out, y) if vs == self._layout.virtual_stages - 1 else None
        if loss is not None:
            return (loss[0] / loss[1] if isinstance(loss, tuple) else loss).cpu()
        return on_device(out, device="cpu")
