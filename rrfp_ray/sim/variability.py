"""Seeded duration traces: what every op and every message of one iteration costs.

A :class:`Trace` holds milliseconds per virtual stage ``vs`` (``vs = chunk * P + stage``)
and microbatch ``m``: ``F``, ``B`` (input gradient) and ``W`` (weight gradient) per op, and
per message ``commF[vs][m]`` (activation vs -> vs+1) and ``commB[vs][m]`` (gradient
vs+1 -> vs) for ``vs`` in ``0..V-2``. :func:`generate` builds one from named scenarios,
which compose with ``+`` (``"multimodal+comm"``) and are applied in order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import numpy as np

from rrfp_ray.schedule.actions import Action, Kind
from rrfp_ray.schedule.deps import Message

Rows = tuple[tuple[float, ...], ...]

OP_KEYS = ("F", "B", "W")
COMM_KEYS = ("commF", "commB")
_HEADER = MappingProxyType({"P": "stages", "M": "microbatches", "v": "chunks"})
_JITTER_SIGMA = 0.05  # the light stages of the multimodal scenario


def _expected_rows(key: str, *, stages: int, chunks: int) -> tuple[int, str]:
    if key in OP_KEYS:
        return stages * chunks, f"virtual stages, expected {stages * chunks} (P={stages} x v={chunks})"
    return stages * chunks - 1, f"links, expected {stages * chunks - 1} (P={stages} x v={chunks} - 1)"


def _rows(key: str, value: Any, *, stages: int, microbatches: int, chunks: int) -> Rows:
    """Validated rows of one key as floats, or ValueError naming the key and index."""
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(f"trace key {key!r} must be a list of rows, got {type(value).__name__}")
    count, expected = _expected_rows(key, stages=stages, chunks=chunks)
    if len(value) != count:
        raise ValueError(f"trace key {key!r} has {len(value)} {expected}")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, Sequence) or isinstance(row, str):
            raise ValueError(f"trace {key}[{i}] must be a list of numbers, got {type(row).__name__}")
        if len(row) != microbatches:
            raise ValueError(f"trace {key}[{i}] has {len(row)} microbatches, expected M={microbatches}")
        for m, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise ValueError(f"trace {key}[{i}][{m}] = {x!r}: durations must be numbers")
            if not (math.isfinite(x) and x >= 0):
                raise ValueError(f"trace {key}[{i}][{m}] = {x!r}: durations must be finite and >= 0")
        rows.append(tuple(float(x) for x in row))
    return tuple(rows)


def _count(name: str, value: Any) -> int:
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

    def __post_init__(self) -> None:
        for name in _HEADER.values():
            _count(name, getattr(self, name))
        for key in OP_KEYS + COMM_KEYS:
            rows = _rows(
                key, getattr(self, key), stages=self.stages, microbatches=self.microbatches, chunks=self.chunks
            )
            object.__setattr__(self, key, rows)

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
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Trace:
        if not isinstance(data, Mapping):
            raise ValueError(f"trace must be a JSON object, got {type(data).__name__}")
        keys = tuple(_HEADER) + OP_KEYS + COMM_KEYS
        for key in keys:
            if key not in data:
                raise ValueError(f"trace key {key!r} is missing")
        extra = sorted(set(data) - set(keys))
        if extra:
            raise ValueError(f"trace has unknown keys {extra}; expected {list(keys)}")
        header = {name: _count(f"trace key {key!r}", data[key]) for key, name in _HEADER.items()}
        return cls(**header, **{key: data[key] for key in OP_KEYS + COMM_KEYS})

    def save(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))


@dataclass(frozen=True)
class _Draft:
    """Mutable arrays a scenario edits in place; ops are (V, M), messages (V-1, M)."""

    stages: int
    ops: tuple[np.ndarray, ...]
    comm: tuple[np.ndarray, ...]

    def physical_stage(self) -> np.ndarray:
        """Physical stage of every virtual-stage row."""
        return np.arange(self.ops[0].shape[0]) % self.stages


def _factor(rng: np.random.Generator, *, sigma: float, size: tuple[int, ...]) -> np.ndarray:
    """Mean-1 lognormal factors: exp(sigma*z - sigma^2/2)."""
    return np.exp(sigma * rng.standard_normal(size) - sigma**2 / 2)


def _none(draft: _Draft, rng: np.random.Generator) -> None:
    """Constant durations."""
    del draft, rng


def _lognormal(draft: _Draft, rng: np.random.Generator, *, sigma: float) -> None:
    """Every op times an independent mean-1 lognormal factor exp(sigma*z - sigma^2/2); messages untouched."""
    for a in draft.ops:
        a *= _factor(rng, sigma=sigma, size=a.shape)


def _straggler(draft: _Draft, rng: np.random.Generator, *, p: float, k: float) -> None:
    """Every op (the F, B and W entries independently) is k times slower with probability p."""
    for a in draft.ops:
        a[rng.random(a.shape) < p] *= k


def _imbalance(draft: _Draft, rng: np.random.Generator, *, rho: float) -> None:
    """Every op of the last physical stage (all its chunks) takes rho x; draws nothing."""
    del rng
    last = draft.physical_stage() == draft.stages - 1
    for a in draft.ops:
        a[last] *= rho


def _comm(draft: _Draft, rng: np.random.Generator, *, comm_ms: float, sigma: float) -> None:
    """Every message latency is comm_ms times a mean-1 lognormal factor (heavy tail).

    comm_ms is the mean, so the median is comm_ms*exp(-sigma^2/2); P95/P5 = exp(2*1.645*sigma),
    ~59 at the default sigma 1.24 (the measured spread was 58.7).
    """
    for a in draft.comm:
        a[:] = comm_ms * _factor(rng, sigma=sigma, size=a.shape)


def _multimodal(draft: _Draft, rng: np.random.Generator, *, sigma: float, frac: float) -> None:
    """One mean-1 lognormal load per microbatch, shared by all its ops on the heavy stages.

    The heavy stages are the first round(frac*P) physical stages (all chunks), like a vision
    encoder whose cost follows the image count; the others get independent sigma 0.05 jitter.
    """
    load = _factor(rng, sigma=sigma, size=(draft.ops[0].shape[1],))
    heavy = draft.physical_stage() < math.floor(frac * draft.stages + 0.5)
    for a in draft.ops:
        a[heavy] *= load
        a[~heavy] *= _factor(rng, sigma=_JITTER_SIGMA, size=a[~heavy].shape)


_REGISTRY: Mapping[str, Callable[..., None]] = MappingProxyType(
    {
        "none": _none,
        "lognormal": _lognormal,
        "straggler": _straggler,
        "imbalance": _imbalance,
        "comm": _comm,
        "multimodal": _multimodal,
    }
)
_DEFAULTS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "none": MappingProxyType({}),
        "lognormal": MappingProxyType({"sigma": 0.3}),
        "straggler": MappingProxyType({"p": 0.05, "k": 3.0}),
        "imbalance": MappingProxyType({"rho": 1.5}),
        "comm": MappingProxyType({"comm_ms": 1.0, "sigma": 1.24}),
        "multimodal": MappingProxyType({"sigma": 0.6, "frac": 0.5}),
    }
)

SCENARIOS: tuple[str, ...] = tuple(_REGISTRY)

_PARAM_RULES: Mapping[str, tuple[Callable[[float], bool], str]] = MappingProxyType(
    {
        "sigma": (lambda x: x >= 0, ">= 0"),
        "p": (lambda x: 0 <= x <= 1, "in [0, 1]"),
        "k": (lambda x: x >= 1, ">= 1"),
        "rho": (lambda x: x > 0, "> 0"),
        "frac": (lambda x: 0 <= x <= 1, "in [0, 1]"),
        "comm_ms": (lambda x: x >= 0, ">= 0"),
        "t_f": (lambda x: x > 0, "> 0"),
        "b_ratio": (lambda x: x > 0, "> 0"),
        "w_split": (lambda x: 0 <= x <= 1, "in [0, 1]"),
    }
)


def _param(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"parameter {name!r} must be a finite number, got {value!r}")
    ok, rule = _PARAM_RULES[name.rpartition(".")[2]]
    if not ok(value):
        raise ValueError(f"parameter {name!r} must be {rule}, got {value!r}")
    return float(value)


def scenario_params(name: str) -> dict[str, float]:
    """The parameters a scenario takes, with their defaults."""
    _known(name)
    return dict(_DEFAULTS[name])


def describe(name: str) -> str:
    """What a scenario does (for CLI help)."""
    _known(name)
    return " ".join(str(_REGISTRY[name].__doc__).split())


def _known(name: str) -> None:
    if name not in _REGISTRY:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")


def _resolve(names: list[str], params: Mapping[str, Any]) -> list[dict[str, float]]:
    """Per scenario in ``names``, its parameters: defaults, then plain names, then ``scenario.param``."""
    for name in names:
        _known(name)
    resolved = [dict(_DEFAULTS[name]) for name in names]
    for key, value in params.items():
        target, _, param = key.rpartition(".")
        hits = [r for name, r in zip(names, resolved) if param in r and target in ("", name)]
        if not hits:
            takes = "; ".join(f"{name}: {', '.join(_DEFAULTS[name]) or '-'}" for name in names)
            raise ValueError(f"unknown parameter {key!r} for scenario {'+'.join(names)!r} (takes {takes})")
        for r in hits:
            r[param] = _param(key, value)
    return resolved


def generate(
    *,
    scenario: str,
    stages: int,
    microbatches: int,
    chunks: int,
    seed: int,
    t_f: float = 20.0,
    b_ratio: float = 2.0,
    w_split: float = 0.5,
    comm_ms: float | None = None,
    **params: float,
) -> Trace:
    """A seeded trace for ``scenario`` (one of SCENARIOS, or several joined with '+').

    Base: F = t_f per op (per virtual stage), B + W = b_ratio * t_f with W the w_split share,
    every message comm_ms (0.0 when None). The scenarios then apply in order, all drawing
    from one ``numpy.random.default_rng(seed)``. ``comm_ms`` given also sets the comm
    scenario's mean latency (its default is 1.0). A plain parameter (``sigma=0.8``) goes to
    every listed scenario that takes it; ``**{"multimodal.sigma": 0.8}`` to one only.
    ``none`` and ``imbalance`` draw nothing, so their traces do not depend on the seed.
    """
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        _count(name, value)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    base = {
        name: _param(name, value)
        for name, value in (("t_f", t_f), ("b_ratio", b_ratio), ("w_split", w_split), ("comm_ms", comm_ms or 0.0))
    }
    names = [part.strip() for part in scenario.split("+")]
    if comm_ms is not None and "comm" in names:
        params = {"comm_ms": comm_ms, **params}
    resolved = _resolve(names, params)

    V, M = stages * chunks, microbatches
    backward = base["b_ratio"] * base["t_f"]
    draft = _Draft(
        stages=stages,
        ops=(
            np.full((V, M), base["t_f"]),
            np.full((V, M), backward * (1 - base["w_split"])),
            np.full((V, M), backward * base["w_split"]),
        ),
        comm=tuple(np.full((V - 1, M), base["comm_ms"]) for _ in COMM_KEYS),
    )
    rng = np.random.default_rng(seed)
    for name, kwargs in zip(names, resolved):
        _REGISTRY[name](draft, rng, **kwargs)
    arrays = dict(zip(OP_KEYS + COMM_KEYS, draft.ops + draft.comm))
    return Trace(
        stages=stages,
        microbatches=microbatches,
        chunks=chunks,
        **{key: tuple(tuple(row) for row in a.tolist()) for key, a in arrays.items()},
    )
