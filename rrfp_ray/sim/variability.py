"""Seeded duration traces: what every op and every message of one iteration costs.

A :class:`Trace` holds milliseconds per virtual stage ``vs`` (``vs = chunk * P + stage``)
and microbatch ``m``: ``F``, ``B`` (input gradient) and ``W`` (weight gradient) per op, and
per message ``commF[vs][m]`` (activation vs -> vs+1) and ``commB[vs][m]`` (gradient
vs+1 -> vs) for ``vs`` in ``0..V-2`` (`rrfp_ray.sim.trace`). :func:`generate` builds one from
named scenarios, which compose with ``+`` (``"multimodal+comm"``) and are applied in order;
:func:`generate_iterations` builds a run of them, where some scenarios persist or drift from one
iteration to the next. Scenarios whose load the data shows (``multimodal``, ``varlen``) record
it as the trace's ``features``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from rrfp_ray.sim.trace import COMM_KEYS, OP_KEYS, Trace, check_count

_JITTER_SIGMA = 0.05  # the light stages of the multimodal scenario
_BYTES_PER_TOKEN = 4096.0  # activation bytes one real token of varlen text holds per virtual stage
_ITERATION, _PERSISTENT, _DRIFT = 1, 2, 3  # tags of the seeded streams beside the iteration's own


@dataclass(frozen=True)
class _Draft:
    """Mutable arrays a scenario edits in place; ops are (V, M), messages (V-1, M)."""

    stages: int
    ops: tuple[np.ndarray, ...]
    comm: tuple[np.ndarray, ...]
    seed: int
    iteration: int
    shown: dict[str, np.ndarray] = field(default_factory=dict)  # features (M,), activation_bytes (V, M)

    def stream(self, tag: int, index: int) -> np.random.Generator:
        """A seeded stream of its own for state that outlives one iteration (tag, index name it)."""
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(tag, index)))

    def show(self, features: np.ndarray) -> None:
        """Record what the data shows of each microbatch (composing scenarios multiply)."""
        self.shown["features"] = self.shown.get("features", 1.0) * features

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
    draft.show(load)


def _varlen(draft: _Draft, rng: np.random.Generator, *, sigma: float, tokens: float, docs: float) -> None:
    """Variable-length text: microbatch m holds docs documents of round(tokens / docs x a mean-1 lognormal)
    real tokens each (>= 1), whose sum it shows, and every op on every stage scales with it; activations
    take 4096 bytes a token. With docs > 1 the trace records each document's tokens (packable)."""
    count = int(docs)
    lengths = np.maximum(1.0, np.round(tokens / count * _factor(rng, sigma=sigma, size=(draft.ops[0].shape[1], count))))
    real = lengths.sum(axis=1)
    for a in draft.ops:
        a *= real / tokens
    draft.show(real)
    draft.shown["activation_bytes"] = np.tile(real * _BYTES_PER_TOKEN, (draft.ops[0].shape[0], 1))
    if count > 1:
        draft.shown["samples"] = lengths


def _persistent(draft: _Draft, rng: np.random.Generator, *, k: float, span: float) -> None:
    """One physical stage is k times slower (all its ops) for span iterations, then the slowness moves
    to another stage, drawn from the seed; the iteration's own draws are untouched."""
    del rng
    stage = int(draft.stream(_PERSISTENT, 0).integers(draft.stages))
    for epoch in range(1, draft.iteration // int(span) + 1):
        if draft.stages > 1:
            stage = (stage + 1 + int(draft.stream(_PERSISTENT, epoch).integers(draft.stages - 1))) % draft.stages
    slow = draft.physical_stage() == stage
    for a in draft.ops:
        a[slow] *= k


def _drift(draft: _Draft, rng: np.random.Generator, *, sigma: float) -> None:
    """Every physical stage's speed walks: from iteration 1 on, each iteration multiplies its ops by a
    further exp(sigma*z), z drawn from the seed per stage and iteration; iteration 0 is unchanged."""
    del rng
    steps = draft.stream(_DRIFT, 0).standard_normal((draft.iteration, draft.stages))
    speed = np.exp(sigma * steps.sum(axis=0))[draft.physical_stage()]
    for a in draft.ops:
        a *= speed[:, None]


_REGISTRY: Mapping[str, Callable[..., None]] = MappingProxyType(
    {
        "none": _none,
        "lognormal": _lognormal,
        "straggler": _straggler,
        "imbalance": _imbalance,
        "comm": _comm,
        "multimodal": _multimodal,
        "varlen": _varlen,
        "persistent": _persistent,
        "drift": _drift,
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
        "varlen": MappingProxyType({"sigma": 0.5, "tokens": 2048.0, "docs": 1.0}),
        "persistent": MappingProxyType({"k": 2.0, "span": 4.0}),
        "drift": MappingProxyType({"sigma": 0.1}),
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
        "tokens": (lambda x: x >= 1, ">= 1"),
        "span": (lambda x: x >= 1 and x == int(x), "an integer >= 1"),
        "docs": (lambda x: x >= 1 and x == int(x), "an integer >= 1"),
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
    iteration: int = 0,
    **params: float,
) -> Trace:
    """A seeded trace for ``scenario`` (one of SCENARIOS, or several joined with '+').

    Base: F = t_f per op (per virtual stage), B + W = b_ratio * t_f with W the w_split share,
    every message comm_ms (0.0 when None). The scenarios then apply in order, all drawing
    from one ``numpy.random.default_rng(seed)``. ``comm_ms`` given also sets the comm
    scenario's mean latency (its default is 1.0). A plain parameter (``sigma=0.8``) goes to
    every listed scenario that takes it; ``**{"multimodal.sigma": 0.8}`` to one only.
    ``none`` and ``imbalance`` draw nothing, so their traces do not depend on the seed.
    ``iteration`` k > 0 draws from a stream of its own (k = 0 is the seed's single trace) and
    places the scenarios that outlive an iteration (``persistent``, ``drift``) at k.
    """
    for name, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        check_count(name, value)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"iteration must be an integer >= 0, got {iteration!r}")
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
        seed=seed,
        iteration=iteration,
    )
    rng = np.random.default_rng(seed) if iteration == 0 else draft.stream(_ITERATION, iteration)
    for name, kwargs in zip(names, resolved):
        _REGISTRY[name](draft, rng, **kwargs)
    arrays = dict(zip(OP_KEYS + COMM_KEYS, draft.ops + draft.comm))
    return Trace(
        stages=stages,
        microbatches=microbatches,
        chunks=chunks,
        **{key: tuple(tuple(row) for row in a.tolist()) for key, a in arrays.items()},
        features=tuple(draft.shown["features"].tolist()) if "features" in draft.shown else None,
        activation_bytes=(
            tuple(tuple(row) for row in draft.shown["activation_bytes"].tolist())
            if "activation_bytes" in draft.shown
            else None
        ),
        samples=tuple(tuple(row) for row in draft.shown["samples"].tolist()) if "samples" in draft.shown else None,
    )


def generate_iterations(*, iterations: int, **kwargs: Any) -> tuple[Trace, ...]:
    """Iterations 0..iterations-1 of one seeded run: `generate` with ``iteration=k`` and the same arguments."""
    check_count("iterations", iterations)
    return tuple(generate(iteration=k, **kwargs) for k in range(iterations))
