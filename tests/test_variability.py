import json
import math
from dataclasses import replace

import numpy as np
import pytest

from rrfp_ray.schedule.actions import Action, Kind, Placement
from rrfp_ray.schedule.layout import Layout, Message
from rrfp_ray.sim.trace import Trace
from rrfp_ray.sim.variability import SCENARIOS, describe, generate, scenario_params

RANDOM = ("lognormal", "straggler", "comm", "multimodal")
SEEDS = (0, 1, 7, 123)


def trace(scenario: str, *, stages: int = 4, microbatches: int = 8, chunks: int = 1, seed: int = 0, **params):
    return generate(scenario=scenario, stages=stages, microbatches=microbatches, chunks=chunks, seed=seed, **params)


def arrays(t: Trace) -> dict[str, np.ndarray]:
    keys = ("F", "B", "W", "commF", "commB")
    return {key: np.array(getattr(t, key), dtype=float).reshape(-1, t.microbatches) for key in keys}


def numbered(*, stages: int, microbatches: int, chunks: int) -> Trace:
    """A trace whose every entry is distinct: key offset + 100 * row + column."""
    V = stages * chunks

    def rows(offset: int, count: int) -> list[list[float]]:
        return [[offset + 100 * i + m for m in range(microbatches)] for i in range(count)]

    return Trace(
        stages=stages,
        microbatches=microbatches,
        chunks=chunks,
        F=rows(10_000, V),
        B=rows(20_000, V),
        W=rows(30_000, V),
        commF=rows(40_000, V - 1),
        commB=rows(50_000, V - 1),
    )


@pytest.mark.parametrize("scenario", SCENARIOS + ("multimodal+comm", "straggler+imbalance+lognormal"))
@pytest.mark.parametrize("stages,microbatches,chunks", [(1, 1, 1), (2, 3, 1), (4, 8, 2), (3, 5, 3)])
def test_shapes(scenario, stages, microbatches, chunks):
    t = trace(scenario, stages=stages, microbatches=microbatches, chunks=chunks)
    V = stages * chunks
    for key in ("F", "B", "W"):
        assert len(getattr(t, key)) == V
        assert all(len(row) == microbatches for row in getattr(t, key))
    for key in ("commF", "commB"):
        assert len(getattr(t, key)) == V - 1
        assert all(len(row) == microbatches for row in getattr(t, key))
    t.check(stages=stages, microbatches=microbatches, chunks=chunks)
    assert isinstance(t.F, tuple) and isinstance(t.F[0], tuple) and isinstance(t.F[0][0], float)


def test_none_is_the_base():
    t = trace("none", chunks=2, t_f=10.0, b_ratio=3.0, w_split=0.25, comm_ms=0.5)
    a = arrays(t)
    assert np.all(a["F"] == 10.0)
    assert np.all(a["B"] == 22.5)
    assert np.all(a["W"] == 7.5)
    assert np.all(a["commF"] == 0.5) and np.all(a["commB"] == 0.5)
    default = arrays(trace("none"))
    assert np.all(default["F"] == 20.0) and np.all(default["B"] == 20.0) and np.all(default["W"] == 20.0)
    assert np.all(default["commF"] == 0.0)


@pytest.mark.parametrize("scenario", SCENARIOS + ("multimodal+comm",))
def test_deterministic(scenario):
    assert trace(scenario, seed=5, chunks=2) == trace(scenario, seed=5, chunks=2)


@pytest.mark.parametrize("scenario", RANDOM)
def test_seed_changes_random_scenarios(scenario):
    assert trace(scenario, seed=1, microbatches=32) != trace(scenario, seed=2, microbatches=32)


@pytest.mark.parametrize("scenario", ("none", "imbalance"))
def test_seedless_scenarios_ignore_seed(scenario):
    assert trace(scenario, seed=1) == trace(scenario, seed=2)


def test_frozen():
    t = trace("none")
    with pytest.raises(AttributeError):
        t.F = ()  # type: ignore[misc]


def test_lognormal_preserves_means():
    a = arrays(trace("lognormal", stages=4, chunks=2, microbatches=2000, seed=3, t_f=10.0, b_ratio=3.0, w_split=0.4))
    assert a["F"].mean() == pytest.approx(10.0, rel=0.02)
    assert a["B"].mean() == pytest.approx(18.0, rel=0.02)
    assert a["W"].mean() == pytest.approx(12.0, rel=0.02)
    assert np.std(np.log(a["F"])) == pytest.approx(0.3, rel=0.05)
    assert np.all(a["commF"] == 0.0)


def test_lognormal_sigma_zero_is_constant():
    assert trace("lognormal", sigma=0.0) == trace("none")


def test_straggler_frequency_and_size():
    a = arrays(trace("straggler", stages=4, microbatches=5000, seed=4, p=0.1, k=4.0))
    for key in ("F", "B", "W"):
        slow = a[key] == 80.0
        assert np.all(slow | (a[key] == 20.0))
        assert slow.mean() == pytest.approx(0.1, abs=0.01)
    f_slow, b_slow = a["F"] == 80.0, a["B"] == 80.0
    assert (f_slow & b_slow).mean() == pytest.approx(0.01, abs=0.005)  # independent per op


def test_straggler_edges():
    assert trace("straggler", p=0.0) == trace("none")
    assert np.all(arrays(trace("straggler", p=1.0, k=2.0))["F"] == 40.0)


@pytest.mark.parametrize("stages,chunks", [(1, 1), (4, 1), (4, 2), (3, 3)])
def test_imbalance_hits_only_the_last_stage(stages, chunks):
    a = arrays(trace("imbalance", stages=stages, chunks=chunks, rho=2.5))
    last = [vs for vs in range(stages * chunks) if vs % stages == stages - 1]
    assert len(last) == chunks
    for key in ("F", "B", "W"):
        for vs in range(stages * chunks):
            assert np.all(a[key][vs] == (50.0 if vs in last else 20.0))


def test_comm_spread_matches_measurement():
    a = arrays(trace("comm", stages=8, microbatches=5000, seed=11))
    latencies = np.concatenate([a["commF"].ravel(), a["commB"].ravel()])
    assert latencies.size == 70_000
    p5, p95 = np.percentile(latencies, [5, 95])
    assert math.exp(2 * 1.645 * 1.24) == pytest.approx(59.1, abs=0.1)
    assert p95 / p5 == pytest.approx(59.0, rel=0.15)
    assert latencies.mean() == pytest.approx(1.0, rel=0.05)  # comm_ms is the mean
    assert np.all(a["F"] == 20.0)


def test_comm_ms_sets_the_mean_and_the_base():
    a = arrays(trace("comm", microbatches=4000, comm_ms=3.0, sigma=0.5))
    assert a["commB"].mean() == pytest.approx(3.0, rel=0.05)
    assert np.std(np.log(a["commB"])) == pytest.approx(0.5, rel=0.05)
    assert np.all(arrays(trace("lognormal", comm_ms=2.0))["commF"] == 2.0)


def test_multimodal_shares_a_load_per_microbatch_on_heavy_stages():
    stages, chunks = 4, 2
    a = arrays(trace("multimodal", stages=stages, chunks=chunks, microbatches=20_000, seed=2))
    heavy = [vs for vs in range(stages * chunks) if vs % stages < 2]
    light = [vs for vs in range(stages * chunks) if vs % stages >= 2]
    load = a["F"][heavy[0]] / 20.0
    for key in ("F", "B", "W"):
        np.testing.assert_allclose(a[key][heavy] / 20.0, np.broadcast_to(load, (len(heavy), load.size)))
        assert a[key][light].mean() == pytest.approx(20.0, rel=0.01)
        assert np.std(np.log(a[key][light])) == pytest.approx(0.05, rel=0.05)
    assert load.mean() == pytest.approx(1.0, rel=0.03)
    assert np.std(np.log(load)) == pytest.approx(0.6, rel=0.05)


@pytest.mark.parametrize("stages,frac,heavy", [(4, 0.5, 2), (3, 0.5, 2), (1, 0.5, 1), (4, 0.0, 0), (4, 1.0, 4)])
def test_multimodal_frac_picks_stages(stages, frac, heavy):
    a = arrays(trace("multimodal", stages=stages, microbatches=50, frac=frac, sigma=1.0))
    spread = [np.std(np.log(a["F"][s])) for s in range(stages)]
    assert [x > 0.5 for x in spread] == [s < heavy for s in range(stages)]


def test_composition_applies_in_order():
    for seed in SEEDS:
        plain = arrays(trace("lognormal", seed=seed, chunks=2))
        both = arrays(trace("lognormal+imbalance", seed=seed, chunks=2))
        last = [3, 7]
        np.testing.assert_allclose(both["F"][last], 1.5 * plain["F"][last])
        np.testing.assert_array_equal(np.delete(both["F"], last, axis=0), np.delete(plain["F"], last, axis=0))
        mixed = arrays(trace("multimodal+comm", seed=seed))
        assert np.all(mixed["commF"] > 0) and np.unique(mixed["commF"]).size > 1
        assert np.unique(mixed["F"][0]).size > 1


def test_qualified_parameter_goes_to_one_scenario():
    plain = trace("multimodal+comm", microbatches=2000, sigma=0.0)
    assert np.all(arrays(plain)["commF"] == 1.0)
    assert np.all(arrays(plain)["F"][0] == 20.0)
    one = arrays(trace("multimodal+comm", microbatches=2000, **{"multimodal.sigma": 0.0}))
    assert np.all(one["F"][0] == 20.0)
    assert np.std(np.log(one["commF"])) == pytest.approx(1.24, rel=0.05)


def test_scenario_params_and_describe():
    assert SCENARIOS == (
        "none",
        "lognormal",
        "straggler",
        "imbalance",
        "comm",
        "multimodal",
        "varlen",
        "persistent",
        "drift",
    )
    assert scenario_params("none") == {}
    assert scenario_params("lognormal") == {"sigma": 0.3}
    assert scenario_params("straggler") == {"p": 0.05, "k": 3.0}
    assert scenario_params("imbalance") == {"rho": 1.5}
    assert scenario_params("comm") == {"comm_ms": 1.0, "sigma": 1.24}
    assert scenario_params("multimodal") == {"sigma": 0.6, "frac": 0.5}
    scenario_params("comm")["sigma"] = 9.0
    assert scenario_params("comm")["sigma"] == 1.24
    assert "mean" in describe("comm")
    with pytest.raises(ValueError, match="unknown scenario 'bogus'; known: none, lognormal"):
        scenario_params("bogus")


def _action(kind: Kind, *, virtual_stage: int, microbatch: int, stages: int = 4) -> Action:
    return Placement.LOOPED.action(kind=kind, virtual_stage=virtual_stage, microbatch=microbatch, stages=stages)


def test_duration_of_each_kind():
    """I is the trace's B, W its W, a full backward B both."""
    t = numbered(stages=4, microbatches=6, chunks=2)
    assert t.duration(_action(Kind.F, virtual_stage=6, microbatch=5)) == 10_605
    assert t.duration(_action(Kind.I, virtual_stage=5, microbatch=3)) == 20_503
    assert t.duration(_action(Kind.B, virtual_stage=5, microbatch=3)) == 20_503 + 30_503
    assert t.duration(_action(Kind.W, virtual_stage=5, microbatch=3)) == 30_503


@pytest.mark.parametrize(
    "action,field",
    [
        (_action(Kind.F, virtual_stage=8, microbatch=0), "virtual stage 8"),
        (_action(Kind.F, virtual_stage=11, microbatch=0), "virtual stage 11"),
        (_action(Kind.B, virtual_stage=0, microbatch=6), "microbatch 6"),
        (_action(Kind.B, virtual_stage=0, microbatch=-1), "microbatch -1"),
    ],
)
def test_duration_rejects_actions_outside(action, field):
    with pytest.raises(ValueError, match=field):
        numbered(stages=4, microbatches=6, chunks=2).duration(action)


def test_latency_index_mapping():
    t = numbered(stages=4, microbatches=6, chunks=2)
    assert t.latency(Message(kind=Kind.F, virtual_stage=1, microbatch=2)) == 40_002  # commF[0]: 0 -> 1
    assert t.latency(Message(kind=Kind.F, virtual_stage=7, microbatch=5)) == 40_605  # commF[6]: 6 -> 7
    assert t.latency(Message(kind=Kind.B, virtual_stage=0, microbatch=2)) == 50_002  # commB[0]: 1 -> 0
    assert t.latency(Message(kind=Kind.B, virtual_stage=6, microbatch=4)) == 50_604  # commB[6]: 7 -> 6
    for bad in (
        Message(kind=Kind.F, virtual_stage=0, microbatch=0),
        Message(kind=Kind.B, virtual_stage=7, microbatch=0),
        Message(kind=Kind.F, virtual_stage=8, microbatch=0),
        Message(kind=Kind.B, virtual_stage=-1, microbatch=0),
    ):
        with pytest.raises(ValueError, match="no [FB] delivery into virtual stage"):
            t.latency(bad)
    with pytest.raises(ValueError, match="microbatch 6"):
        t.latency(Message(kind=Kind.F, virtual_stage=1, microbatch=6))


def test_latency_covers_every_message_the_layout_sends():
    layout = Layout(stages=3, chunks=2, microbatches=4, split=True)
    t = numbered(stages=3, microbatches=4, chunks=2)
    sent = [
        (layout.vs(a), a.kind, layout.sends(a))
        for s in range(3)
        for a in layout.actions(stage=s)
        if layout.sends(a) is not None
    ]
    assert len(sent) == 2 * 5 * 4
    for vs, kind, message in sent:
        # the message leaving vs is on link row vs (F: vs -> vs+1) or vs-1 (B: vs -> vs-1)
        expected = 40_000 + 100 * vs if kind is Kind.F else 50_000 + 100 * (vs - 1)
        assert t.latency(message) == expected + message.microbatch


def test_json_round_trip(tmp_path):
    for seed in SEEDS:
        t = trace("multimodal+comm+straggler", stages=3, chunks=2, microbatches=5, seed=seed)
        data = t.to_json()
        assert (data["P"], data["M"], data["v"]) == (3, 5, 2)
        assert Trace.from_json(json.loads(json.dumps(data))) == t
        path = tmp_path / f"trace{seed}.json"
        t.save(path)
        assert Trace.load(path) == t


def test_property_every_trace_is_valid():
    for seed in SEEDS:
        for scenario in SCENARIOS + ("multimodal+comm", "imbalance+straggler"):
            for stages, chunks in ((1, 1), (2, 2), (4, 1)):
                t = trace(scenario, stages=stages, chunks=chunks, microbatches=6, seed=seed)
                a = arrays(t)
                for key, values in a.items():
                    assert np.all(np.isfinite(values)) and np.all(values >= 0), (scenario, key)
                for key in ("F", "B", "W"):
                    assert np.all(a[key] > 0), (scenario, key)
                layout = Layout(stages=stages, chunks=chunks, microbatches=6, split=True)
                for s in range(stages):
                    for action in layout.actions(stage=s):
                        assert t.duration(action) > 0
                        need = layout.message_need(action)
                        if need is not None:
                            assert t.latency(need) >= 0
                        if action.kind is Kind.I:
                            full, w = replace(action, kind=Kind.B), replace(action, kind=Kind.W)
                            assert t.duration(full) == pytest.approx(t.duration(action) + t.duration(w))


def test_property_straggler_only_slows():
    for seed in SEEDS:
        a = arrays(trace("straggler", seed=seed, microbatches=64, p=0.3, k=2.0))
        for key in ("F", "B", "W"):
            assert set(np.unique(a[key])) <= {20.0, 40.0}


def good_json() -> dict:
    return numbered(stages=4, microbatches=3, chunks=2).to_json()


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: d.update(F=d["F"][:3]), r"trace key 'F' has 3 virtual stages, expected 8 \(P=4 x v=2\)"),
        (lambda d: d.update(commB=d["commB"][:-1]), r"trace key 'commB' has 6 links, expected 7"),
        (lambda d: d["W"][2].pop(), r"trace W\[2\] has 2 microbatches, expected M=3"),
        (lambda d: d["F"][2].__setitem__(1, -1.0), r"trace F\[2\]\[1\] = -1.0: durations must be finite and >= 0"),
        (lambda d: d["B"][0].__setitem__(2, float("nan")), r"trace B\[0\]\[2\] = nan: durations must be finite"),
        (lambda d: d["commF"][6].__setitem__(0, float("inf")), r"trace commF\[6\]\[0\] = inf: durations must be"),
        (lambda d: d["F"][1].__setitem__(0, "3"), r"trace F\[1\]\[0\] = '3': durations must be numbers"),
        (lambda d: d["F"].__setitem__(1, 5.0), r"trace F\[1\] must be a list of numbers"),
        (lambda d: d.update(B=7), r"trace key 'B' must be a list of rows"),
        (lambda d: d.pop("commF"), r"trace key 'commF' is missing"),
        (lambda d: d.update(seed=3), r"trace has unknown keys \['seed'\]"),
        (lambda d: d.update(P=0), r"trace key 'P' must be an integer >= 1, got 0"),
        (lambda d: d.update(v=2.0), r"trace key 'v' must be an integer >= 1, got 2.0"),
        (lambda d: d.update(M=4), r"trace F\[0\] has 3 microbatches, expected M=4"),
    ],
)
def test_from_json_rejects(edit, message):
    data = good_json()
    edit(data)
    with pytest.raises(ValueError, match=message):
        Trace.from_json(data)


def test_load_rejects_bad_file(tmp_path):
    data = good_json()
    data["F"][2][1] = -1.0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"trace F\[2\]\[1\] = -1.0"):
        Trace.load(path)
    with pytest.raises(ValueError, match="trace must be a JSON object"):
        Trace.from_json([1, 2])  # type: ignore[arg-type]


def test_check_names_the_key():
    t = trace("none", stages=4, chunks=2, microbatches=6)
    with pytest.raises(ValueError, match=r"trace key 'F' has 8 virtual stages, expected 4 \(P=4 x v=1\)"):
        t.check(stages=4, microbatches=6, chunks=1)
    with pytest.raises(ValueError, match=r"trace F\[0\] has 6 microbatches, expected M=7"):
        t.check(stages=4, microbatches=7, chunks=2)
    with pytest.raises(ValueError, match=r"trace key 'P' is 4, expected 8"):
        t.check(stages=8, microbatches=6, chunks=1)
    small = trace("none", stages=3, chunks=1, microbatches=6)
    with pytest.raises(ValueError, match=r"trace key 'F' has 3 virtual stages, expected 8 \(P=4 x v=2\)"):
        small.check(stages=4, microbatches=6, chunks=2)


def test_unknown_scenario():
    known = "none, lognormal, straggler, imbalance, comm, multimodal, varlen, persistent, drift"
    with pytest.raises(ValueError, match=rf"unknown scenario 'gauss'; known: {known}$"):
        trace("gauss")
    with pytest.raises(ValueError, match=r"unknown scenario ''"):
        trace("comm+")


@pytest.mark.parametrize(
    "scenario,params,message",
    [
        ("lognormal", {"sigma": -0.1}, r"parameter 'sigma' must be >= 0, got -0.1"),
        ("comm", {"sigma": -1}, r"parameter 'sigma' must be >= 0"),
        ("multimodal+comm", {"comm.sigma": -1.0}, r"parameter 'comm.sigma' must be >= 0"),
        ("straggler", {"p": 1.5}, r"parameter 'p' must be in \[0, 1\], got 1.5"),
        ("straggler", {"p": -0.1}, r"parameter 'p' must be in \[0, 1\]"),
        ("straggler", {"k": 0.5}, r"parameter 'k' must be >= 1, got 0.5"),
        ("imbalance", {"rho": 0.0}, r"parameter 'rho' must be > 0, got 0.0"),
        ("multimodal", {"frac": 2.0}, r"parameter 'frac' must be in \[0, 1\]"),
        ("none", {"t_f": 0.0}, r"parameter 't_f' must be > 0, got 0.0"),
        ("none", {"t_f": -5.0}, r"parameter 't_f' must be > 0"),
        ("none", {"b_ratio": 0.0}, r"parameter 'b_ratio' must be > 0"),
        ("none", {"w_split": 1.5}, r"parameter 'w_split' must be in \[0, 1\]"),
        ("none", {"comm_ms": -1.0}, r"parameter 'comm_ms' must be >= 0"),
        ("lognormal", {"sigma": float("nan")}, r"parameter 'sigma' must be a finite number, got nan"),
        ("lognormal", {"sigma": "0.3"}, r"parameter 'sigma' must be a finite number"),
        ("straggler", {"sigma": 0.3}, r"unknown parameter 'sigma' for scenario 'straggler' \(takes straggler: p, k\)"),
        ("none", {"rho": 2.0}, r"unknown parameter 'rho' for scenario 'none' \(takes none: -\)"),
        ("comm", {"multimodal.sigma": 0.3}, r"unknown parameter 'multimodal.sigma'"),
        ("none", {"stages": 0}, r"stages must be an integer >= 1, got 0"),
        ("none", {"microbatches": 0}, r"microbatches must be an integer >= 1"),
        ("none", {"chunks": 1.5}, r"chunks must be an integer >= 1"),
        ("none", {"seed": -1}, r"seed must be an integer >= 0, got -1"),
    ],
)
def test_bad_params(scenario, params, message):
    with pytest.raises(ValueError, match=message):
        trace(scenario, **params)


def test_trace_constructor_validates():
    with pytest.raises(ValueError, match="stages must be an integer >= 1"):
        Trace(stages=0, microbatches=1, chunks=1, F=[], B=[], W=[], commF=[], commB=[])
    with pytest.raises(ValueError, match=r"trace W\[0\]\[0\] = -2: durations must be finite and >= 0"):
        Trace(stages=1, microbatches=1, chunks=1, F=[[1]], B=[[1]], W=[[-2]], commF=[], commB=[])
