import logging
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session; reuses one already started in this process."""
    import ray

    from actors.local_ray import init_ray

    started_here = init_ray(num_cpus=16, log_to_driver=False)
    yield ray
    if started_here:
        ray.shutdown()


@pytest.fixture
def job_logging():
    """For a job's main() run in this process: put back the library loggers' levels its --log-level set."""
    from rrfp_ray.cli import LIBRARY_LOGGERS

    levels = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
