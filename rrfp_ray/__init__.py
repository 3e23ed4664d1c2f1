"""rrfp-ray: readiness-driven pipeline-parallel training; the public API.

    from rrfp_ray import PipelineConfig, Trainer

Names are imported on first use, so `import rrfp_ray.simulator` (or any light module)
does not pay for torch. Nothing here imports ray: the Ray backend is
`actors.backend.RayBackend`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Trainer": "rrfp_ray.api",
    "InMemoryData": "rrfp_ray.api",
    "make_workload": "rrfp_ray.api",
    "Backend": "rrfp_ray.backend",
    "Checkpointing": "rrfp_ray.checkpoint",
    "LocalBackend": "rrfp_ray.backend",
    "PipelineConfig": "rrfp_ray.config",
    "DataSource": "rrfp_ray.training",
    "Optim": "rrfp_ray.training",
    "FactoryOptim": "rrfp_ray.training",
    "IterationReport": "rrfp_ray.telemetry",
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
    from rrfp_ray.api import InMemoryData, Trainer, make_workload
    from rrfp_ray.backend import Backend, LocalBackend
    from rrfp_ray.checkpoint import Checkpointing
    from rrfp_ray.config import PipelineConfig
    from rrfp_ray.telemetry import IterationReport
    from rrfp_ray.training import DataSource, FactoryOptim, Optim


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rrfp_ray' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
