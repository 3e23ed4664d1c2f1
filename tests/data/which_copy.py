"""Submitted by tests/test_dashboard_head.py: which copy of rrfp_ray a job and its actors import."""

import ray

import rrfp_ray


@ray.remote
def actor_copy() -> str:
    import rrfp_ray as library

    return library.__file__


ray.init(address="auto")
print(f"job imports {rrfp_ray.__file__}")
print(f"task imports {ray.get(actor_copy.remote())}")
