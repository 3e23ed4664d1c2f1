"""The cost model: what each op will take, from recent telemetry and what the data shows.

Per block (a virtual stage for the planner; a layer, or a device's probe, for the rebalancer) and op
kind it keeps the measured durations of the last few iterations, each with its data microbatch's
feature, and fits ``duration = intercept + slope * feature`` robustly (Theil-Sen: the median of
pairwise slopes), so a block whose cost does not follow the feature learns a slope near 0. When a new
iteration's durations sit far from the fit (a stage slowed down or recovered), the older ones are
dropped and the fit restarts from the new, unless `restart` is off (the rebalancer's: one value per
layer and iteration, noisy on a busy host, whose fit is the plain median of its window). The spread
is the robust standard deviation of the log residuals.

The planner keeps a model per backward family (:class:`Backward`, :class:`BackwardCosts`): an iteration that
ran a full backward teaches the full family's, one that ran the split halves the split family's, forwards
included, since on a device the two families' ops need not cost alike (on a CPU the split's halves cost more than
one full backward, and the forwards beside them slow down). A family not yet run is predicted from the other,
and one not run for a while moves as the other family's forwards have moved since it last learned.

A :class:`Fit` is additive, so the costs of any grouping of blocks (a virtual stage made of
layers, or a rebalanced one) are the sum of their fits. Before any telemetry the prior is a cost
proportional to the feature (mean 1), or 1 without features.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rrfp_ray.observe.telemetry import IterationReport
from rrfp_ray.plan.fits import Fit, median, robust_fit
from rrfp_ray.schedule.actions import Kind, parse_action

log = logging.getLogger(__name__)

_SHIFT_MIN = 0.1  # a log shift of the median below this (about 10%) never counts as a change
_SHIFT_SIGMAS = 4.0  # a change: the new median off the fit by this many of its standard errors
BYTES = "bytes"  # the pseudo-kind under which activation bytes are kept, against the cost feature
PADDED = "bytes-padded"  # activation bytes again, against what a microbatch holds padded (`padded_size`)
PROBE = "probe"  # the pseudo-kind under which a device's time for the reference computation is kept


_parsed = functools.lru_cache(maxsize=1 << 14)(parse_action)  # every iteration reports the same action texts


Key = tuple[int, str]  # (block, kind): kind is an op kind's letter (F, I, W, B), BYTES or PROBE


@dataclass
class CostModel:
    """Recent observations per (block, kind) and their fits; the state is plain data (`to_dict`)."""

    window: int = 4  # iterations of telemetry kept per key
    restart: bool = True  # a new iteration far from the fit drops the older ones (False: the window's plain fit)
    observations: dict[Key, list[tuple[int, float, float]]] = field(default_factory=dict)  # (iteration, x, y)
    _fits: dict[Key, Fit] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")

    def fit(self, key: Key) -> Fit | None:
        if key not in self._fits and self.observations.get(key):
            _, x, y = (np.array(c, dtype=float) for c in zip(*self.observations[key]))
            self._fits[key] = robust_fit(x, y)
        return self._fits.get(key)

    def level(self, key: Key) -> float | None:
        """The fit at feature 1: for a key observed without features, the robust median of its recent
        values; None before any observation."""
        fit = self.fit(key)
        return None if fit is None else fit.predict(1.0)

    def add(self, *, key: Key, iteration: int, samples: Sequence[tuple[float, float]]) -> bool:
        """Record one iteration's (feature, value) samples of a key; True when they showed a change."""
        old = self.fit(key) if self.restart else None
        changed = False
        if old is not None and samples:
            logs = [math.log(max(y, 1e-12) / max(old.predict(x), 1e-12)) for x, y in samples]
            shift = abs(median(np.array(logs)))
            changed = shift > max(_SHIFT_MIN, _SHIFT_SIGMAS * 1.25 * old.sigma / math.sqrt(len(samples)))
        kept = [] if changed else [o for o in self.observations.get(key, []) if o[0] > iteration - self.window]
        self.observations[key] = kept + [(iteration, float(x), float(y)) for x, y in samples]
        self._fits.pop(key, None)
        return changed

    def observe(
        self,
        *,
        report: IterationReport,
        order: Sequence[int],
        features: Sequence[float] | None,
        activation_bytes: Sequence[Sequence[float]] | None = None,
        padded: Sequence[float] | None = None,
    ) -> list[Key]:
        """Learn from one iteration's ops; slot i ran data microbatch order[i]; `activation_bytes[vs][j]`
        of data microbatch j (None: every microbatch weighs 1), fitted against the features and, with `padded`
        (per data microbatch, its padded size), against that too. Returns the keys that changed."""
        stages = 1 + max((e.stage for e in report.events), default=0)
        samples: dict[Key, list[tuple[float, float]]] = {}
        blocks = 0
        for event in report.events:
            action = _parsed(event.action, stages=stages)
            data = order[action.microbatch]
            blocks = max(blocks, action.virtual_stage + 1)
            samples.setdefault((action.virtual_stage, action.kind.value), []).append(
                (feature_of(features, data), event.end_ms - event.start_ms)
            )
        if activation_bytes is None:
            activation_bytes = [[1.0] * len(order) for _ in range(blocks)]
        samples.update(byte_samples(activation_bytes=activation_bytes, features=features, padded=padded))
        return [key for key, s in sorted(samples.items()) if self.add(key=key, iteration=report.iteration, samples=s)]

    def observe_bytes(
        self,
        *,
        iteration: int,
        activation_bytes: Sequence[Sequence[float]],
        features: Sequence[float] | None,
        padded: Sequence[float] | None,
    ) -> None:
        """Learn one iteration's activation bytes alone (`observe`'s byte part)."""
        samples = byte_samples(activation_bytes=activation_bytes, features=features, padded=padded)
        for key, s in sorted(samples.items()):
            self.add(key=key, iteration=iteration, samples=s)

    def activation_bytes(
        self, *, block: int, features: Sequence[float] | None, count: int, padded: Sequence[float] | None = None
    ) -> list[float] | None:
        """Predicted activation bytes of data microbatches 0..count-1 on `block`; None before any were seen. With
        `padded` (per microbatch, its padded size), the fit against it where it misses the observed bytes by less
        than the features' fit (a stage whose bytes follow the padded sequence, not the sum of its samples)."""
        fit = self.fit((block, BYTES))
        if fit is None:
            return None
        by_padded = None if padded is None else self.fit((block, PADDED))
        if by_padded is not None and self._miss((block, PADDED)) < self._miss((block, BYTES)):
            return [by_padded.predict(float(padded[j])) for j in range(count)]
        return [fit.predict(feature_of(features, j)) for j in range(count)]

    def _miss(self, key: Key) -> float:
        """Mean absolute difference between a key's observed values and its fit (not in logs: a microbatch that
        holds no bytes on a stage counts by what the fit gives it, not without bound)."""
        fit = self.fit(key)
        return float(np.mean([abs(y - fit.predict(x)) for _, x, y in self.observations[key]]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "restart": self.restart,
            "observations": [[block, kind, [list(o) for o in obs]] for (block, kind), obs in self.observations.items()],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        return cls(
            window=int(data["window"]),
            restart=bool(data.get("restart", True)),
            observations={
                (int(block), str(kind)): [(int(k), float(x), float(y)) for k, x, y in obs]
                for block, kind, obs in data["observations"]
            },
        )


def byte_samples(
    *, activation_bytes: Sequence[Sequence[float]], features: Sequence[float] | None, padded: Sequence[float] | None
) -> dict[Key, list[tuple[float, float]]]:
    """Per block, (feature, bytes) of each data microbatch, and (padded size, bytes) where `padded` is given."""
    samples: dict[Key, list[tuple[float, float]]] = {}
    for block, row in enumerate(activation_bytes):
        samples[(block, BYTES)] = [(feature_of(features, j), b) for j, b in enumerate(row)]
        if padded is not None:
            samples[(block, PADDED)] = [(float(padded[j]), b) for j, b in enumerate(row)]
    return samples


def padded_size(samples: Sequence[float]) -> float:
    """What a microbatch of samples with these features holds where each is padded to the longest: their count
    times the longest (a decoder's sequence over a packed microbatch); sums and padded sizes agree for one sample."""
    return len(samples) * max(samples)


def feature_of(features: Sequence[float] | None, microbatch: int) -> float:
    return 1.0 if features is None else float(features[microbatch])


def prior(features: Sequence[float] | None) -> Fit:
    """Before telemetry: cost proportional to the feature with mean 1 (1 per op without features)."""
    if features is None or not any(features):
        return Fit(intercept=1.0, slope=0.0)
    return Fit(intercept=0.0, slope=len(features) / sum(features))


class Backward(enum.Enum):
    """A backward family: one full backward (B) per microbatch and stage, or its split halves (I, then W)."""

    FULL = "full"
    SPLIT = "split"

    @classmethod
    def of(cls, *, split: bool) -> Backward:
        return cls.SPLIT if split else cls.FULL

    @property
    def other(self) -> Backward:
        return Backward.FULL if self is Backward.SPLIT else Backward.SPLIT

    @property
    def kinds(self) -> tuple[Kind, ...]:
        """The op kinds an iteration of this family runs."""
        return (Kind.F, Kind.B) if self is Backward.FULL else (Kind.F, Kind.I, Kind.W)


@dataclass
class BackwardCosts:
    """A cost model per backward family, each taught only by the iterations that ran it; a family's op kind not
    yet measured is predicted from the other family (`kind_fit`).

    Where one family has not run for a while, its costs are as old as its last iteration, and a load or a
    straggler since then moved the other family's alone. So each family keeps, per block, the other family's
    forward fit as it stood when the family last learned (its anchor), and its costs are predicted scaled by how
    far the other family's forwards have moved since (`drift`): the two families' costs keep their measured ratio,
    at the level the fresher one sees now."""

    window: int = 4
    models: dict[Backward, CostModel] = field(default_factory=dict)
    anchors: dict[Backward, dict[int, Fit]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for family in Backward:
            self.models.setdefault(family, CostModel(window=self.window))
            self.anchors.setdefault(family, {})

    def observe(
        self,
        *,
        report: IterationReport,
        family: Backward,
        order: Sequence[int],
        features: Sequence[float] | None,
        activation_bytes: Sequence[Sequence[float]] | None = None,
        padded: Sequence[float] | None = None,
    ) -> list[Key]:
        """Learn from one iteration that ran `family`'s backward (`CostModel.observe`); the keys that changed."""
        model = self.models[family]
        changed = model.observe(
            report=report, order=order, features=features, activation_bytes=activation_bytes, padded=padded
        )
        other = self.models[family.other]
        self.anchors[family] = {
            block: fit
            for block, kind in model.observations
            if kind == Kind.F.value and (fit := other.fit((block, Kind.F.value))) is not None
        }
        return changed

    def observed(self, family: Backward) -> bool:
        """Whether an iteration of `family` has been measured (its backward's ops on any block)."""
        backward = {k.value for k in family.kinds} - {Kind.F.value}
        return any(kind in backward and obs for (_, kind), obs in self.models[family].observations.items())

    def untaught(self) -> bool:
        """Whether no op of either family has been measured yet (every cost is the prior)."""
        kinds = {k.value for k in Kind}
        return not any(obs for m in self.models.values() for (_, kind), obs in m.observations.items() if kind in kinds)

    def drift(self, *, family: Backward, block: int, features: Sequence[float] | None) -> float:
        """How far the other family's forwards on `block` have moved since `family` last learned (at the features'
        mean): 1 where either was never measured."""
        anchor = self.anchors[family].get(block)
        now = self.models[family.other].fit((block, Kind.F.value))
        if anchor is None or now is None:
            return 1.0
        x = 1.0 if features is None or not len(features) else float(np.mean(features))
        then = anchor.predict(x)
        return now.predict(x) / then if then > 0 else 1.0

    def measured(self, *, family: Backward, block: int, kind: Kind, features: Sequence[float] | None) -> Fit | None:
        """`family`'s own fit of `kind` on `block`, scaled by its drift; None where it never measured it."""
        fit = self.models[family].fit((block, kind.value))
        if fit is None:
            return None
        scale = self.drift(family=family, block=block, features=features)
        return Fit(intercept=fit.intercept * scale, slope=fit.slope * scale, sigma=fit.sigma)

    def kind_fit(self, *, block: int, kind: Kind, family: Backward, features: Sequence[float] | None) -> Fit:
        """The fit of `kind` on `block` in an iteration of `family` (each measured fit `measured`, drift included).
        A forward: as measured beside `family`'s backward, else beside the other. The split halves (I, W): as
        measured, else half a measured full B each. A full B: as measured, else its halves together. Else the prior
        (for B, its halves' priors). A full backward's own fit is kept apart from I + W: on some devices it costs
        less."""
        split, full = Backward.SPLIT, Backward.FULL
        if kind is Kind.F:
            own = self.measured(family=family, block=block, kind=kind, features=features)
            fit = (
                own
                if own is not None
                else self.measured(family=family.other, block=block, kind=kind, features=features)
            )
            return prior(features) if fit is None else fit
        if kind is Kind.B:
            own = self.measured(family=full, block=block, kind=kind, features=features)
            if own is not None:
                return own
            halves = (self.kind_fit(block=block, kind=k, family=split, features=features) for k in (Kind.I, Kind.W))
            return sum(halves, start=Fit(intercept=0.0, slope=0.0))
        own = self.measured(family=split, block=block, kind=kind, features=features)
        if own is not None:
            return own
        if (whole := self.measured(family=full, block=block, kind=Kind.B, features=features)) is not None:
            return Fit(intercept=whole.intercept / 2, slope=whole.slope / 2, sigma=whole.sigma)
        return prior(features)

    def durations(
        self, *, block: int, kind: Kind, family: Backward, features: Sequence[float] | None, count: int
    ) -> list[float]:
        """Predicted ms of `kind` on `block`, beside `family`'s backward, for data microbatches 0..count-1."""
        fit = self.kind_fit(block=block, kind=kind, family=family, features=features)
        return [fit.predict(feature_of(features, j)) for j in range(count)]

    def activation_bytes(
        self, *, block: int, features: Sequence[float] | None, count: int, padded: Sequence[float] | None = None
    ) -> list[float] | None:
        """Predicted activation bytes of data microbatches 0..count-1 on `block` (`CostModel.activation_bytes`),
        from the family measured last; None before any were seen."""
        latest = max(
            self.models.values(), key=lambda m: max((o[0] for o in m.observations.get((block, BYTES), [])), default=-1)
        )
        return latest.activation_bytes(block=block, features=features, count=count, padded=padded)

    def to_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            **{family.value: model.to_dict() for family, model in self.models.items()},
            "anchors": {
                family.value: [[block, fit.intercept, fit.slope, fit.sigma] for block, fit in anchors.items()]
                for family, anchors in self.anchors.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackwardCosts:
        if "anchors" not in data:  # one model for both families: what it learned cannot be told apart
            log.warning("the planner's saved costs do not tell the backward families apart; learning them afresh")
            return cls(window=int(data["window"]))
        return cls(
            window=int(data["window"]),
            models={family: CostModel.from_dict(data[family.value]) for family in Backward},
            anchors={
                family: {
                    int(block): Fit(intercept=float(a), slope=float(b), sigma=float(c))
                    for block, a, b, c in data["anchors"][family.value]
                }
                for family in Backward
            },
        )
