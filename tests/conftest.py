import logging

import pytest


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test` runs two workers, `--dist loadgroup`), every test that
    uses Ray runs on one worker, so a run starts one local Ray; the in-process tests share out
    over the workers."""
    for item in items:
        if item.path.name.endswith("_ray.py") or "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))
