"""Train a byte-level GPT through a readiness-driven (RRFP) pipeline on Ray: `actors/train_gpt.py`
(installed as `rrfp-train`), runnable by path as `ray job submit` runs it:

    python jobs/train_gpt.py --help
"""

from __future__ import annotations

from rrfp_ray.installed import require_core

require_core(program="train_gpt.py")  # before the first import of torch or ray

from actors.train_gpt import main, parse, train
from rrfp_ray.job import run_job

__all__ = ["main", "parse", "train"]

if __name__ == "__main__":
    run_job(main)
