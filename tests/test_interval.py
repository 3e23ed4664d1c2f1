"""The switch interval stages compute with: set while held, the caller's restored after, in-process too."""

from __future__ import annotations

import sys
import threading

import pytest

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.executor import ExecutorWrapper
from rrfp_ray.runtime.interval import STAGE_INTERVAL_S, switch_interval
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import LocalBackend

CALLER_S = 3e-3  # not CPython's default, so a restore to the default would show


@pytest.fixture(autouse=True)
def callers_interval():
    found = sys.getswitchinterval()
    sys.setswitchinterval(CALLER_S)
    yield
    sys.setswitchinterval(found)


def test_overlapping_holds_keep_the_first_s_interval_and_the_last_restores_the_caller_s():
    entered, release = threading.Event(), threading.Event()
    seen: list[float] = []

    def other() -> None:
        with switch_interval(1e-3):
            seen.append(sys.getswitchinterval())
            entered.set()
            release.wait(timeout=10)

    with switch_interval(2e-4):
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(timeout=10)
    assert seen == [pytest.approx(2e-4)]
    assert sys.getswitchinterval() == pytest.approx(2e-4)  # the other thread still holds it
    release.set()
    thread.join(timeout=10)
    assert sys.getswitchinterval() == pytest.approx(CALLER_S)
    with switch_interval(None):
        assert sys.getswitchinterval() == pytest.approx(CALLER_S)
    with pytest.raises(ValueError, match="> 0"):
        with switch_interval(0.0):
            pass


class Recording(ExecutorWrapper):
    def __init__(self, inner, seen: list[float]) -> None:
        super().__init__(inner)
        self.seen = seen

    def run(self, **kwargs):
        self.seen.append(sys.getswitchinterval())
        return self.inner.run(**kwargs)


@pytest.mark.parametrize("interval", [STAGE_INTERVAL_S, None])
def test_the_in_process_backend_runs_its_stage_threads_at_its_interval_and_then_restores_the_caller_s(interval):
    P, M = 2, 4
    layout = Layout(stages=P, chunks=1, microbatches=M)
    trace = generate(scenario="none", stages=P, microbatches=M, chunks=1, seed=0, t_f=0.5)
    workload = SyntheticWorkload(trace=trace, payload_elems=4)
    seen: list[float] = []
    with LocalBackend.over(layout=layout) as local:
        local.switch_interval_s = interval
        executors = [Recording(workload.executor(stage=s, layout=layout), seen) for s in range(P)]
        local.run_iteration(
            iteration=0, policy=make_policy(name="1f1b", stages=P, chunks=1, microbatches=M), cap=Cap.parse("1x"),
            executors=executors,
        )  # fmt: skip
    assert len(seen) == P * 2 * M
    assert seen == pytest.approx([CALLER_S if interval is None else interval] * len(seen))
    assert sys.getswitchinterval() == pytest.approx(CALLER_S)
