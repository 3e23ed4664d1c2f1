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

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(
            num_cpus=16,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
        )
    yield ray
    if started_here:
        ray.shutdown()
