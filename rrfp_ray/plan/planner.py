"""The planner: plans each iteration from the cost model and what its data shows.

`Planner.plan` predicts the iteration (mean durations per data microbatch, and a few noise
samples drawn from the measured spread; activation bytes per microbatch), searches a plan over them
(`rrfp_ray.plan.search`) and validates it; `Planner.observe` feeds one iteration's telemetry to the cost model. Its
state (configuration, cost model, last plan) is plain data (`to_dict`), and every random draw comes
from (seed, iteration), so a planner restored from a checkpoint plans exactly as one that never
stopped.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.costs import Backward, BackwardCosts, feature_of, padded_size
from rrfp_ray.plan.packing import Packing, packed_padded, packings
from rrfp_ray.plan.plans import Plan, policy_for
from rrfp_ray.plan.prior import adaptive, hypothesised
from rrfp_ray.plan.scoring import Samples, planned_byte_limits
from rrfp_ray.plan.search import budgets, search
from rrfp_ray.policy.caps import Cap
from rrfp_ray.schedule.actions import Kind
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.memory import DataBytes
from rrfp_ray.sim.trace import Trace

log = logging.getLogger(__name__)

HINTS = ("bfw", "ready-zb-h1", "zb-h1", "1f1b", "bf")  # one chunk per stage; the first is the default
HINTS_INTERLEAVED = ("bfw", "ready-interleaved", "interleaved", "bf")
FIXED = ("zb-h1", "1f1b")
FIXED_INTERLEAVED = ("interleaved",)


def default_hints(*, chunks: int, fixed_only: bool = False) -> tuple[str, ...]:
    if fixed_only:
        return FIXED if chunks == 1 else FIXED_INTERLEAVED
    return HINTS if chunks == 1 else HINTS_INTERLEAVED


class Arrangement(enum.Enum):
    """What a plan arranges besides its hint and cap: the order of the data microbatches, the packing of the
    samples into microbatches (where the data shows its samples), or both."""

    ORDER = "order"
    PACKING = "packing"
    BOTH = "both"

    @property
    def orders(self) -> bool:
        return self is not Arrangement.PACKING

    @property
    def packs(self) -> bool:
        return self is not Arrangement.ORDER


@dataclass(frozen=True)
class PlannerConfig:
    """`simulations`: the search budget in simulated iterations. The default, 32, keeps a plan to tens of
    milliseconds of CPU at P=8, M=32 (`python jobs/bench_simulator.py` prints what one simulated iteration costs),
    which matters where the planner shares cores with the stages (the in-process fabric); 128 finds plans about
    0.5% better there (docs/results/planning.md compares the two); `samples`: noise samples per candidate;
    `time_limit_s`: a wall-clock limit that only stops a search early (None: none); `wait_s`: the
    longest an iteration waits for the plan made for it while the iteration before ran
    (`rrfp_ray.plan.ahead`) before it runs the last plan instead; `arrange`: what a plan arranges (packing only
    where the iteration's samples are shown; without ordering, each plan runs the microbatches in their order);
    `learn_backwards`: run each backward (split, full) once before assuming its cost, since on a device a full
    backward can cost less than its split halves; off where a full backward is I + W by definition (a simulated
    trace), so nothing is there to learn."""

    hints: tuple[str, ...]
    cap: Cap
    simulations: int = 32
    samples: int = 2
    seed: int = 0
    window: int = 4
    time_limit_s: float | None = None
    wait_s: float = 1.0
    arrange: Arrangement = Arrangement.BOTH
    learn_backwards: bool = True

    def __post_init__(self) -> None:
        if not self.hints:
            raise ValueError("hints must name at least one policy")
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.simulations < self.samples:
            raise ValueError(f"simulations must be >= samples = {self.samples}, got {self.simulations}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if not self.wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {self.wait_s}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "hints": list(self.hints),
            "cap": str(self.cap),
            "simulations": self.simulations,
            "samples": self.samples,
            "seed": self.seed,
            "window": self.window,
            "time_limit_s": self.time_limit_s,
            "wait_s": self.wait_s,
            "arrange": self.arrange.value,
            "learn_backwards": self.learn_backwards,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PlannerConfig:
        arrange = Arrangement(data.get("arrange", Arrangement.BOTH.value))
        return cls(**{**data, "hints": tuple(data["hints"]), "cap": Cap.parse(data["cap"]), "arrange": arrange})


class Planner:
    def __init__(
        self,
        *,
        config: PlannerConfig,
        stages: int,
        chunks: int,
        microbatches: int,
        model: BackwardCosts | None = None,
        last: Plan | None = None,
        planned: int | None = None,
        ranks: tuple[int, ...] | None = None,
    ) -> None:
        self.config = config
        self.shape = {"stages": stages, "chunks": chunks, "microbatches": microbatches}
        for hint in config.hints:
            policy_for(name=hint, **self.shape)  # ValueError naming a hint this pipeline refuses
        self.model = model if model is not None else BackwardCosts(window=config.window)
        self.last = last or Plan.identity(microbatches=microbatches, hint=config.hints[0], cap=config.cap)
        self.last.validate(**self.shape)
        self.planned = planned  # the iteration `last` was planned for (None: none yet)
        self.ranks = ranks  # `last`'s slots by the rank of their microbatch's predicted cost (`Found.ranks`)
        zeros = [[0.0] * microbatches] * (stages * chunks)
        self._idle = Trace(F=zeros, B=zeros, W=zeros, commF=zeros[1:], commB=zeros[1:], **self.shape)  # all ops 0 ms

    def predicted(
        self, *, iteration: int, features: Sequence[float] | None, padded: Sequence[float] | None = None
    ) -> Samples:
        """The iteration as the model sees it: the mean, or `samples` noisy draws around it; each with the split
        backward's costs (F, I, W as measured beside it) and, beside it, with the full backward's own (F, B); the
        two forwards of a draw share its noise."""
        P, v, M = self.shape["stages"], self.shape["chunks"], self.shape["microbatches"]
        if features is not None and len(features) != M:
            raise ValueError(f"features has {len(features)} entries, expected M={M}")
        split, full = Backward.SPLIT, Backward.FULL
        kinds = ((Kind.F, split), (Kind.I, split), (Kind.W, split), (Kind.F, full), (Kind.B, full))
        fits = [
            [self.model.kind_fit(block=vs, kind=k, family=f, features=features) for vs in range(P * v)]
            for k, f in kinds
        ]
        mean = [np.array([[fit.predict(feature_of(features, j)) for j in range(M)] for fit in row]) for row in fits]
        sigma = [np.array([f.sigma for f in row])[:, None] for row in fits]
        rng = np.random.default_rng(np.random.SeedSequence(self.config.seed, spawn_key=(iteration,)))
        draws = (
            [mean]
            if all(not s.any() for s in sigma)
            else [noisy(mean=mean, sigma=sigma, rng=rng) for _ in range(self.config.samples)]
        )
        held = self.predicted_bytes(features=features, padded=padded)
        base = self._idle.replaced(activation_bytes=held)
        return Samples(
            [base.replaced(F=f, B=i, W=w) for f, i, w, _, _ in draws],
            unsplit=[base.replaced(F=f, B=b) for _, _, _, f, b in draws],
        )

    def predicted_bytes(
        self, *, features: Sequence[float] | None, padded: Sequence[float] | None = None
    ) -> list[list[float]]:
        """Per virtual stage and data microbatch, the activation bytes the model predicts: fitted from
        telemetry (against the features, or the padded sizes `padded` where those fit better), else proportional
        to the features (1 each without features)."""
        P, v, M = self.shape["stages"], self.shape["chunks"], self.shape["microbatches"]
        rows = [self.model.activation_bytes(block=vs, features=features, count=M, padded=padded) for vs in range(P * v)]
        if any(row is None for row in rows):
            rows = [[feature_of(features, j) for j in range(M)] for _ in range(P * v)]
        return rows

    def plan(
        self, *, iteration: int, features: Sequence[float] | None, samples: Sequence[Sequence[float]] | None = None
    ) -> Plan:
        """The plan for `iteration` from its features and the telemetry observed so far; with `samples`
        (per microbatch, its samples' cost features) and an arrangement that packs, the plan packs them by their
        predicted costs (`sample_costs`) in each way `packing_shares` gives, searches each packing's order and hint
        (within a share of the budget, `budgets`) and keeps the best."""
        config = self.config
        given_padded = None if samples is None else [padded_size(row) for row in samples]
        options: list[tuple[Packing | None, Sequence[float] | None, Sequence[float] | None]]
        options = [(None, features, given_padded)]
        if samples is not None and config.arrange.packs:
            costs = self.sample_costs(samples=samples, features=features)
            blocks = self.shape["stages"] * self.shape["chunks"]
            options = [*packings(samples=samples, costs=costs, microbatches=self.shape["microbatches"], blocks=blocks)]
        held = None if options[0][0] is None else self.predicted_bytes(features=features, padded=given_padded)
        deadline = None if config.time_limit_s is None else time.monotonic() + config.time_limit_s
        found, packing = None, None
        for (option, option_features, padded), budget in zip(
            options, budgets(simulations=config.simulations, samples=config.samples, count=len(options))
        ):
            predicted = self.predicted(iteration=iteration, features=option_features, padded=padded)
            basis = None if held is None else replace(predicted[0], activation_bytes=held)
            hints = tuple(sorted(self.hints(), key=lambda hint: hint != self.last.hint))  # the last plan's first
            if self.model.untaught() and option_features is not None and min(option_features) < max(option_features):
                guarded = hypothesised(predicted, basis=basis)  # `rrfp_ray.plan.prior`
                if budget >= len(guarded):
                    predicted, basis, hints = guarded, None, adaptive(hints, **self.shape)
            got = search(
                samples=predicted,
                basis=basis,
                previous=self.ranks,
                hints=hints,
                cap=config.cap,
                simulations=budget,
                seed=int(np.random.SeedSequence(config.seed, spawn_key=(iteration, 1)).generate_state(1)[0]),
                deadline=deadline,
                reorder=config.arrange.orders,
            )
            if got is None:
                found = None
                break
            if found is None or got.score_ms < found.score_ms:
                found, packing = got, option
        if found is not None:
            self.last, self.ranks = replace(found.plan, packing=packing), found.ranks
            self.last.validate(**self.shape)
            log.debug("iteration %d: %s (%.1f ms predicted)", iteration, found.plan.hint, found.score_ms)
        else:
            log.warning("iteration %d: no plan within %.3f s; running the last plan", iteration, config.time_limit_s)
        self.planned = iteration
        return self.last

    def data_bytes(
        self, *, plan: Plan, features: Sequence[float] | None, samples: Sequence[Sequence[float]] | None
    ) -> DataBytes:
        """What the runtime's arbiters gate `plan` by, as its search scored it: the predicted activation bytes of
        each (packed) data microbatch, and `plan.cap` over the reference list on the data before packing, in its
        own order (`planned_byte_limits`). `features` and `samples` are the data's as the plan was made from them
        (before packing)."""
        padded = None if samples is None else [padded_size(row) for row in samples]
        basis = rows = self.predicted_bytes(features=features, padded=padded)
        if plan.packing is not None:
            if samples is None:
                raise ValueError("a packed plan's bytes need the samples it packed")
            flat = [x for row in samples for x in row]
            packed_features = [sum(flat[i] for i in group) for group in plan.packing]
            rows = self.predicted_bytes(
                features=packed_features, padded=packed_padded(samples=samples, packing=plan.packing)
            )
        split = plan.validate(**self.shape).split
        limits = planned_byte_limits(
            cap=plan.cap,
            rows=basis,
            split=split,
            stages=self.shape["stages"],
            chunks=self.shape["chunks"],
        )
        return DataBytes(rows=tuple(tuple(row) for row in rows), limits=limits)

    def hints(self) -> tuple[str, ...]:
        """The hints to search now. A backward (split or full) among the hints whose costs the model has not
        observed, nor is about to (the last plan's), is learned before it is assumed: the search keeps to the
        hints of the first such, so the early iterations run each backward once, deterministically (unless the
        config's `learn_backwards` is off)."""
        if not self.config.learn_backwards:
            return self.config.hints
        splits = {hint: policy_for(name=hint, **self.shape).split for hint in self.config.hints}
        pending = None if self.planned is None else splits[self.last.hint]
        for split in dict.fromkeys(splits.values()):
            if split != pending and not self.model.observed(Backward.of(split=split)):
                return tuple(hint for hint in self.config.hints if splits[hint] is split)
        return self.config.hints

    def sample_costs(self, *, samples: Sequence[Sequence[float]], features: Sequence[float] | None) -> list[float]:
        """Per sample (flat, microbatch by microbatch), its predicted ms summed over every block and op kind of the
        last plan's backward: the fits' slope times its feature. A fit's intercept is a microbatch's own, the same
        in every microbatch however packed, so it moves no balance; where no cost follows the feature (slope 0),
        every sample costs 1."""
        blocks = self.shape["stages"] * self.shape["chunks"]
        family = Backward.of(split=policy_for(name=self.last.hint, **self.shape).split)
        slope = sum(
            self.model.kind_fit(block=vs, kind=k, family=family, features=features).slope
            for vs in range(blocks)
            for k in family.kinds
        )
        flat = [float(x) for row in samples for x in row]
        return [slope * x for x in flat] if slope > 0 else [1.0] * len(flat)

    def observe(
        self,
        *,
        report: IterationReport,
        plan: Plan,
        features: Sequence[float] | None,
        activation_bytes: Sequence[Sequence[float]] | None = None,
        padded: Sequence[float] | None = None,
    ) -> None:
        """Feed one iteration's telemetry, run under `plan`, to the cost model of the plan's backward
        (`activation_bytes` and `padded`: per data microbatch as the plan packed them; `measured_bytes`)."""
        changed = self.model.observe(
            report=report,
            family=Backward.of(split=policy_for(name=plan.hint, **self.shape).split),
            order=plan.order,
            features=features,
            activation_bytes=activation_bytes,
            padded=padded,
        )
        if changed:
            log.info("iteration %d: costs changed on %s", report.iteration, changed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "shape": dict(self.shape),
            "model": self.model.to_dict(),
            "last": self.last.to_dict(),
            "planned": self.planned,
            "ranks": None if self.ranks is None else list(self.ranks),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Planner:
        return cls(
            config=PlannerConfig.from_dict(data["config"]),
            **data["shape"],
            model=BackwardCosts.from_dict(data["model"]),
            last=Plan.from_dict(data["last"]),
            planned=data.get("planned"),
            ranks=None if data.get("ranks") is None else tuple(int(r) for r in data["ranks"]),
        )


def noisy(*, mean: Sequence[np.ndarray], sigma: Sequence[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
    """One draw of the predicted durations (`Planner.predicted`'s kinds: split F, I, W, then full F, B), each
    lognormal around its mean with its fit's spread; the full backward's forwards take the split's draws."""
    z = [rng.standard_normal(m.shape) for m in mean]
    z[3] = z[0]
    return [m * np.exp(s * e - s**2 / 2) for m, s, e in zip(mean, sigma, z)]


def measured_bytes(
    *, report: IterationReport, order: Sequence[int], stages: int, chunks: int
) -> list[list[float]] | None:
    """Per virtual stage and data microbatch (slot i ran data microbatch `order[i]`), the activation bytes its
    forward kept in replica 0, as the stages reported them; None where a stage did not measure them."""
    layout = Layout(stages=stages, chunks=chunks, microbatches=len(order))
    measured = {s.stage: s.activation_bytes for s in report.stages if s.replica == 0}
    if any(not measured.get(stage) for stage in range(stages)):
        return None
    rows = [[0.0] * len(order) for _ in range(layout.virtual_stages)]
    for stage, per_chunk in measured.items():
        for chunk, row in enumerate(per_chunk):
            vs = layout.virtual_stage(stage=stage, chunk=chunk)
            for slot, nbytes in enumerate(row):
                rows[vs][order[slot]] = float(nbytes)
    return rows
