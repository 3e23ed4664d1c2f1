"""A duration trace: what every op and every message of one iteration costs, and what its data shows.

A :class:`Trace` holds milliseconds per virtual stage ``vs`` (``vs = chunk * P + stage``)
and microbatch ``m``: ``F``, ``B`` (input gradient) and ``W`` (weight gradient) per op, and
per message ``commF[vs][m]`` (activation vs -> vs+1) and ``commB[vs][m]`` (gradient
vs+1 -> vs) for ``vs`` in ``0..V-2``. Optionally, ``features[m]`` (what the data shows of
microbatch m before the iteration runs: real tokens, images, any cost number),
``activation_bytes[vs][m]``, and ``samples[m]``: the cost feature of each sample microbatch m
holds (their sum is its feature), which :meth:`Trace.repacked` packs anew.

Columns are indexed by *data* microbatch: :meth:`Trace.reordered` puts data microbatch
``order[i]`` in slot ``i``, with its durations, features and bytes. A run of several
iterations is a sequence of traces of one shape, stored as ``{"iterations": [trace, ...]}``;
:func:`load_iterations` reads either form.
"""

from __future__ import annotations

import json
import logging
import math
import operator
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.layout import Message

log = logging.getLogger(__name__)

Rows = tuple[tuple[float, ...], ...]

OP_KEYS = ("F", "B", "W")
COMM_KEYS = ("commF", "commB")
OPTIONAL_KEYS = ("features", "activation_bytes", "samples")
_ROW_KEYS = (*OP_KEYS, *COMM_KEYS, "activation_bytes")  # the fields of rows, each a number per microbatch
_HEADER = MappingProxyType({"P": "stages", "M": "microbatches", "v": "chunks"})


def _expected_rows(key: str, *, stages: int, chunks: int) -> tuple[int, str]:
    if key in COMM_KEYS:
        return stages * chunks - 1, f"links, expected {stages * chunks - 1} (P={stages} x v={chunks} - 1)"
    return stages * chunks, f"virtual stages, expected {stages * chunks} (P={stages} x v={chunks})"


def _numbers(name: str, row: Any, *, microbatches: int, what: str) -> tuple[float, ...]:
    if not isinstance(row, Sequence) or isinstance(row, str):
        raise ValueError(f"trace {name} must be a list of numbers, got {type(row).__name__}")
    if len(row) != microbatches:
        raise ValueError(f"trace {name} has {len(row)} microbatches, expected M={microbatches}")
    for m, x in enumerate(row):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise ValueError(f"trace {name}[{m}] = {x!r}: {what} must be numbers")
        if not (math.isfinite(x) and x >= 0):
            raise ValueError(f"trace {name}[{m}] = {x!r}: {what} must be finite and >= 0")
    return tuple(float(x) for x in row)


def _rows(key: str, value: Any, *, stages: int, microbatches: int, chunks: int) -> Rows:
    """Validated rows of one key as floats, or ValueError naming the key and index."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(f"trace key {key!r} must be a list of rows, got {type(value).__name__}")
    count, expected = _expected_rows(key, stages=stages, chunks=chunks)
    if len(value) != count:
        raise ValueError(f"trace key {key!r} has {len(value)} {expected}")
    what = "bytes" if key == "activation_bytes" else "durations"
    return tuple(_numbers(f"{key}[{i}]", row, microbatches=microbatches, what=what) for i, row in enumerate(value))


def _samples(value: Any, *, microbatches: int) -> Rows:
    """Per microbatch, its samples' features: a list of M non-empty lists of numbers."""
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != microbatches:
        raise ValueError(f"trace key 'samples' must be a list of {microbatches} lists (one per microbatch)")
    rows = []
    for m, row in enumerate(value):
        size = len(row) if isinstance(row, Sequence) and not isinstance(row, str) else 0
        if size == 0:
            raise ValueError(f"trace samples[{m}] must be a non-empty list of numbers")
        rows.append(_numbers(f"samples[{m}]", row, microbatches=size, what="features"))
    return tuple(rows)


def check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class Trace:
    """Durations in ms of one iteration; rows are validated and frozen to tuples."""

    stages: int
    microbatches: int
    chunks: int
    F: Rows
    B: Rows
    W: Rows
    commF: Rows
    commB: Rows
    features: tuple[float, ...] | None = None
    activation_bytes: Rows | None = None
    samples: Rows | None = None

    def __post_init__(self) -> None:
        for name in _HEADER.values():
            check_count(name, getattr(self, name))
        shape = {"stages": self.stages, "microbatches": self.microbatches, "chunks": self.chunks}
        for key in OP_KEYS + COMM_KEYS:
            object.__setattr__(self, key, _rows(key, getattr(self, key), **shape))
        if self.features is not None:
            object.__setattr__(
                self, "features", _numbers("features", self.features, microbatches=self.microbatches, what="features")
            )
        if self.activation_bytes is not None:
            object.__setattr__(self, "activation_bytes", _rows("activation_bytes", self.activation_bytes, **shape))
        if self.samples is not None:
            object.__setattr__(self, "samples", _samples(self.samples, microbatches=self.microbatches))
            totals = [sum(row) for row in self.samples]
            if self.features is None or not all(
                math.isclose(t, f, rel_tol=1e-9, abs_tol=1e-9) for t, f in zip(totals, self.features)
            ):
                raise ValueError("trace key 'samples' must sum, per microbatch, to its 'features'")

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def duration(self, action: Action) -> float:
        """ms of one op: I is the trace's B, W its W, and a full backward B both (B + W)."""
        for name, value, bound in (
            ("virtual stage", action.virtual_stage, self.virtual_stages),
            ("microbatch", action.microbatch, self.microbatches),
        ):
            if not 0 <= value < bound:
                raise ValueError(f"action {action}: {name} {value} outside the trace (0..{bound - 1})")
        vs, m = action.virtual_stage, action.microbatch
        if action.kind is Kind.F:
            return self.F[vs][m]
        if action.kind is Kind.W:
            return self.W[vs][m]
        return self.B[vs][m] if action.kind is Kind.I else self.B[vs][m] + self.W[vs][m]

    def latency(self, message: Message) -> float:
        """ms of one delivery: an activation into vs comes from vs-1, a gradient from vs+1."""
        vs, m = message.virtual_stage, message.microbatch
        if not 0 <= m < self.microbatches:
            raise ValueError(f"message {message}: microbatch {m} outside the trace (0..{self.microbatches - 1})")
        if message.kind is Kind.F and 1 <= vs < self.virtual_stages:
            return self.commF[vs - 1][m]
        if message.kind is Kind.B and 0 <= vs < self.virtual_stages - 1:
            return self.commB[vs][m]
        raise ValueError(
            f"message {message}: no {message.kind.value} delivery into virtual stage {vs} with V={self.virtual_stages}"
        )

    def replaced(self, **rows: Sequence[Sequence[float]] | None) -> Trace:
        """A copy with the given rows (F, B, W, commF, commB, activation_bytes; None: no bytes), as
        `dataclasses.replace` makes it, checked in bulk (shape, finite, >= 0) where they come as float arrays or lists
        of floats (a planner's predictions) rather than number by number: the same trace, float for float. Rows the
        bulk check refuses go through `replace`, which names what is wrong."""
        checked: dict[str, Any] = {}
        for key, value in rows.items():
            if value is None and key == "activation_bytes":
                checked[key] = None
                continue
            array = np.asarray(value) if key in _ROW_KEYS else None
            count = self.virtual_stages - (key in COMM_KEYS)
            if (
                array is None
                or array.dtype != np.float64
                or array.shape != (count, self.microbatches)
                or not ((array >= 0).all() and np.isfinite(array).all())
            ):
                return replace(self, **{k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in rows.items()})
            checked[key] = tuple(map(tuple, array.tolist()))
        return self._with(checked)

    def _with(self, changed: Mapping[str, Any]) -> Trace:
        """This trace with `changed` fields, numbers already checked: not checked again."""
        trace = object.__new__(Trace)
        for field in fields(Trace):
            object.__setattr__(trace, field.name, changed.get(field.name, getattr(self, field.name)))
        return trace

    def reordered(self, order: Sequence[int]) -> Trace:
        """The trace as run when slot i holds data microbatch order[i]: every column moves with its microbatch."""
        if sorted(order) != list(range(self.microbatches)):
            raise ValueError(f"order {list(order)} is not a permutation of the {self.microbatches} microbatches")
        if self.microbatches == 1:
            return self
        column = operator.itemgetter(*order)  # a row's items in the new order, as a tuple

        def moved(rows: Rows) -> Rows:
            return tuple(map(column, rows))

        changed: dict[str, Any] = {key: moved(getattr(self, key)) for key in OP_KEYS + COMM_KEYS}
        if self.features is not None:
            changed["features"] = column(self.features)
        if self.activation_bytes is not None:
            changed["activation_bytes"] = moved(self.activation_bytes)
        if self.samples is not None:
            changed["samples"] = column(self.samples)
        return self._with(changed)  # every number passed this trace's checks, moved to another column

    def repacked(self, packing: Sequence[Sequence[int]]) -> Trace:
        """The trace with its samples packed anew: microbatch i holds the samples `packing[i]` (indexes
        into the samples of all microbatches in order). Its feature is their sum, and its durations and
        bytes are those of slot i scaled by new feature / old (as where costs follow the feature, varlen);
        the messages stay."""
        if self.samples is None or self.features is None:
            raise ValueError("only a trace with 'samples' and 'features' can be repacked")
        flat = [x for row in self.samples for x in row]
        if len(packing) != self.microbatches or sorted(i for g in packing for i in g) != list(range(len(flat))):
            raise ValueError(
                f"packing must place each of the {len(flat)} samples in one of {self.microbatches} microbatches"
            )
        if any(not group for group in packing) or min(self.features) <= 0:
            raise ValueError("packing needs non-empty microbatches and features > 0")
        new = [sum(flat[i] for i in group) for group in packing]
        scale = [n / f for n, f in zip(new, self.features)]

        def scaled(rows: Rows) -> Rows:
            return tuple(tuple(x * k for x, k in zip(row, scale)) for row in rows)

        return Trace(
            stages=self.stages,
            microbatches=self.microbatches,
            chunks=self.chunks,
            **{key: scaled(getattr(self, key)) for key in OP_KEYS},
            **{key: getattr(self, key) for key in COMM_KEYS},
            features=tuple(new),
            activation_bytes=None if self.activation_bytes is None else scaled(self.activation_bytes),
            samples=tuple(tuple(flat[i] for i in group) for group in packing),
        )

    def check(self, *, stages: int, microbatches: int, chunks: int) -> None:
        """ValueError naming the first key whose shape does not fit the given pipeline."""
        for key in OP_KEYS + COMM_KEYS:
            _rows(key, getattr(self, key), stages=stages, microbatches=microbatches, chunks=chunks)
        for key, actual, expected in (
            ("P", self.stages, stages),
            ("M", self.microbatches, microbatches),
            ("v", self.chunks, chunks),
        ):
            if actual != expected:
                raise ValueError(f"trace key {key!r} is {actual}, expected {expected}")

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {key: getattr(self, name) for key, name in _HEADER.items()}
        data.update({key: [list(row) for row in getattr(self, key)] for key in OP_KEYS + COMM_KEYS})
        if self.features is not None:
            data["features"] = list(self.features)
        if self.activation_bytes is not None:
            data["activation_bytes"] = [list(row) for row in self.activation_bytes]
        if self.samples is not None:
            data["samples"] = [list(row) for row in self.samples]
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trace:
        if not isinstance(data, Mapping):
            raise ValueError(f"trace must be a JSON object, got {type(data).__name__}")
        keys = tuple(_HEADER) + OP_KEYS + COMM_KEYS
        for key in keys:
            if key not in data:
                raise ValueError(f"trace key {key!r} is missing")
        extra = sorted(set(data) - set(keys) - set(OPTIONAL_KEYS))
        if extra:
            raise ValueError(
                f"trace has unknown keys {extra}; expected {list(keys)} and optionally {list(OPTIONAL_KEYS)}"
            )
        header = {name: check_count(f"trace key {key!r}", data[key]) for key, name in _HEADER.items()}
        optional = {key: data[key] for key in OPTIONAL_KEYS if key in data}
        return cls(**header, **{key: data[key] for key in OP_KEYS + COMM_KEYS}, **optional)

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """One trace from either form of file; of a multi-iteration file, its first iteration (logged)."""
        traces = load_iterations(path)
        if len(traces) > 1:
            log.warning("%s holds %d iterations; running its first one", path, len(traces))
        return traces[0]


def iterations_from_json(data: Any) -> tuple[Trace, ...]:
    """The traces of a single-trace object or of ``{"iterations": [trace, ...]}`` (all of one shape)."""
    if not (isinstance(data, Mapping) and "iterations" in data):
        return (Trace.from_json(data),)
    if set(data) != {"iterations"}:
        raise ValueError(f"a multi-iteration trace holds only 'iterations', got keys {sorted(data)}")
    items = data["iterations"]
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise ValueError("trace key 'iterations' must be a non-empty list of traces")
    traces = []
    for k, item in enumerate(items):
        try:
            trace = Trace.from_json(item)
            if traces:
                first = traces[0]
                trace.check(stages=first.stages, microbatches=first.microbatches, chunks=first.chunks)
        except ValueError as error:
            raise ValueError(f"iteration {k}: {error}") from None
        traces.append(trace)
    return tuple(traces)


def iterations_to_json(traces: Sequence[Trace]) -> dict[str, Any]:
    return {"iterations": [t.to_json() for t in traces]}


def of_iteration(traces: Sequence[Trace], iteration: int) -> Trace | None:
    """The trace that iteration `iteration` of a run of `traces` replays (they cycle); None where there are none."""
    return traces[iteration % len(traces)] if traces else None


def load_iterations(path: str | os.PathLike[str]) -> tuple[Trace, ...]:
    """Every iteration of a trace file, either form; ValueError naming what is wrong."""
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} is not JSON: {error}") from None
    return iterations_from_json(data)


def save_iterations(traces: Sequence[Trace], path: str | os.PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(iterations_to_json(traces) if len(traces) > 1 else traces[0].to_json(), f)
