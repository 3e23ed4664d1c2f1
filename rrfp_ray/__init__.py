"""rrfp-ray: readiness-driven pipeline-parallel training; the public API.

    from rrfp_ray import PipelineConfig, Trainer

Names are imported on first use, so `import rrfp_ray.sim.simulator` (or any light module)
does not pay for torch. Nothing here imports ray: the Ray backend is
`actors.backend.RayBackend`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Trainer": "rrfp_ray.train.api",
    "InMemoryData": "rrfp_ray.train.build",
    "make_workload": "rrfp_ray.train.build",
    "Backend": "rrfp_ray.train.backend",
    "Checkpointing": "rrfp_ray.train.checkpoint",
    "LocalBackend": "rrfp_ray.train.backend",
    "PipelineConfig": "rrfp_ray.train.config",
    "DataSource": "rrfp_ray.train.sources",
    "Optim": "rrfp_ray.train.optim",
    "FactoryOptim": "rrfp_ray.train.optim",
    "IterationReport": "rrfp_ray.observe.telemetry",
}

__all__ = [
    "Backend",
    "Checkpointing",
    "DataSource",
    "FactoryOptim",
    "InMemoryData",
    "IterationReport",
    "LocalBackend",
    "Optim",
    "PipelineConfig",
    "Trainer",
    "make_workload",
]

if TYPE_CHECKING:
    from rrfp_ray.observe.telemetry import IterationReport
    from rrfp_ray.train.api import Trainer
    from rrfp_ray.train.backend import Backend, LocalBackend
    from rrfp_ray.train.build import InMemoryData, make_workload
    from rrfp_ray.train.checkpoint import Checkpointing
    from rrfp_ray.train.config import PipelineConfig
    from rrfp_ray.train.optim import FactoryOptim, Optim
    from rrfp_ray.train.sources import DataSource


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rrfp_ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
