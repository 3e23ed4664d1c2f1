"""Simulate one iteration under several policies on one duration trace and compare them:
`rrfp_ray/recipes/simulate.py` (installed as `rrfp-simulate`), runnable by path:

    python jobs/simulate.py --help
"""

from __future__ import annotations

from rrfp_ray.job import run_job
from rrfp_ray.recipes.simulate import main

__all__ = ["main"]

if __name__ == "__main__":
    run_job(main)
