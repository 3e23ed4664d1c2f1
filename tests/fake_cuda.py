"""A Ray worker setup hook for tests on machines without a GPU: this worker process "sees
CUDA with cupy" when its node was started with RRFP_FAKE_CUDA=1 in its environment."""

import os


def pretend_cuda_where_told() -> None:
    if os.environ.get("RRFP_FAKE_CUDA") == "1":
        from actors import collective

        collective.nccl_missing = lambda: None
