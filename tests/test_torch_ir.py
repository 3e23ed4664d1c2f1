"""The schedule IR against PyTorch's: text, placement, torch's classes and CSV, hint refusals."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from rrfp_ray.policy.caps import Cap
from rrfp_ray.policy.policy import make_policy
from rrfp_ray.runtime.synthetic import SyntheticWorkload
from rrfp_ray.schedule.actions import Kind, Placement, parse_action
from rrfp_ray.schedule.generators import build
from rrfp_ray.schedule.layout import Layout, Link, Message
from rrfp_ray.schedule.torch_import import imported
from rrfp_ray.schedule.validate import parse_order, read_hint
from rrfp_ray.sim.simulator import simulate
from rrfp_ray.sim.variability import generate
from rrfp_ray.train.backend import LocalBackend

CLASSES = {
    "looped-bfs": torch_schedules.ScheduleLoopedBFS,
    "zb-interleaved": torch_schedules.ScheduleInterleavedZeroBubble,
    "zbv": torch_schedules.ScheduleZBVZeroBubble,
    "dualpipev": torch_schedules.ScheduleDualPipeV,
}


class _Stage:
    def __init__(self, *, vs: int, stages: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = vs, 2 * stages, stages, 0
        self.is_last, self.submod = False, None


def _torch_words(name: str, *, stages: int, microbatches: int) -> dict[int, list[str]]:
    """torch's own compute-only order, flattened as the docs say: OVERLAP_F_B as its F then its B,
    and in a split schedule a full B as I then W."""
    held = [0, 2 * stages - 1] if name in ("zbv", "dualpipev") else [0, stages]
    order = CLASSES[name]([_Stage(vs=vs, stages=stages) for vs in held], microbatches).pipeline_order
    words = {r: [w for a in actions if a is not None for w in (a.sub_actions or (a,))] for r, actions in order.items()}
    out = {r: [str(a) for a in row] for r, row in words.items()}
    if any("I" in w for row in out.values() for w in row):
        out = {
            r: [x for w in row for x in ((w.replace("B", "I"), w.replace("B", "W")) if "B" in w else (w,))]
            for r, row in out.items()
        }
    return out


def test_text_round_trips_through_its_parser() -> None:
    layout = Layout(stages=3, chunks=2, microbatches=4, split=True, placement=Placement.V)
    for s in range(3):
        for action in layout.actions(stage=s):
            again = parse_action(str(action), stages=3, placement=Placement.V)
            assert (again, again.stage, again.chunk) == (action, action.stage, action.chunk)
    assert str(parse_action("5I0", stages=4)) == "5I0"


def test_v_placement_holds_s_and_2p_minus_1_minus_s_with_the_loss_on_stage_0() -> None:
    layout = Layout(stages=3, chunks=2, microbatches=2, placement=Placement.V)
    assert [layout.locate(vs) for vs in range(6)] == [(0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)]
    assert layout.loss_stage == 0
    turn = Message(kind=Kind.F, virtual_stage=3, microbatch=0)
    assert layout.is_local(turn) and layout.dst(turn) == 2
    links = set(layout.links())
    assert Link(src=2, dst=2, kind=Kind.F) not in links and Link(src=2, dst=2, kind=Kind.B) not in links
    assert links == {
        Link(src=a, dst=b, kind=k)
        for a, b, k in [
            (0, 1, Kind.F),
            (1, 2, Kind.F),
            (2, 1, Kind.F),
            (1, 0, Kind.F),
            (1, 0, Kind.B),
            (2, 1, Kind.B),
            (1, 2, Kind.B),
            (0, 1, Kind.B),
        ]
    }
    assert Layout(stages=3, chunks=2, microbatches=2).loss_stage == 2


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (3, 6), (4, 8)])
def test_each_torch_class_is_imported_as_its_pipeline_order(name: str, stages: int, microbatches: int) -> None:
    chunks = 2
    order = build(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
    assert {s: [str(a) for a in actions] for s, actions in order.items()} == _torch_words(
        name, stages=stages, microbatches=microbatches
    )
    placement = Placement.V if name in ("zbv", "dualpipev") else Placement.LOOPED
    assert all(a.stage == s for s, actions in order.items() for a in actions)
    assert make_policy(name=name, stages=stages, chunks=chunks, microbatches=microbatches).placement is placement


def test_a_microbatch_count_torch_refuses_is_refused_with_its_rule() -> None:
    with pytest.raises(ValueError, match="dualpipev.*at least as many microbatches as stages"):
        imported(name="dualpipev", stages=4, chunks=2, microbatches=4)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_need_two_chunks_and_unknown_names_list_the_known(name: str) -> None:
    with pytest.raises(ValueError, match=r"--chunks\) must be 2"):
        make_policy(name=name, stages=4, chunks=1, microbatches=8)
    with pytest.raises(ValueError, match="known: .*zbv.*dualpipev"):
        make_policy(name="zbvv", stages=4, chunks=2, microbatches=8)


@pytest.mark.parametrize("name", ["zbv", "ready-zbv", "dualpipev", "ready-dualpipev"])
def test_v_policies_complete_in_the_simulator_and_in_process(name: str) -> None:
    P, M = 3, 6
    policy = make_policy(name=name, stages=P, chunks=2, microbatches=M)
    trace = generate(scenario="lognormal", stages=P, microbatches=M, chunks=2, seed=1, t_f=1.0)
    report = simulate(policy=policy, trace=trace, cap=Cap.parse("inf"))
    if policy.fixed:
        for s in range(P):
            ran = [e.action for e in sorted(report.events, key=lambda e: e.start_ms) if e.stage == s]
            assert ran == [str(a) for a in policy.order[s]]
    layout = Layout(stages=P, chunks=2, microbatches=M, placement=Placement.V)
    pipeline = LocalBackend.over(layout=layout, timeout_s=20.0)
    try:
        workload = SyntheticWorkload(trace=trace)
        executors = [workload.executor(stage=s, layout=policy.layout_over(layout)) for s in range(P)]
        run = pipeline.run_iteration(iteration=0, policy=policy, cap=Cap.parse("inf"), executors=executors)
    finally:
        pipeline.close()
    assert len(run.events) == len(report.events)


def test_a_csv_written_by_torch_loads_as_a_hint(tmp_path) -> None:
    P, M = 2, 4
    schedule = torch_schedules.ScheduleZBVZeroBubble([_Stage(vs=0, stages=P), _Stage(vs=2 * P - 1, stages=P)], M)
    path = tmp_path / "zbv.csv"
    schedule._dump_csv(str(path))
    hint = parse_order(read_hint(path.read_text()), stages=P, chunks=2, microbatches=M)
    assert hint.placement is Placement.V
    assert hint.order == build(name="zbv", stages=P, chunks=2, microbatches=M)
    policy = make_policy(name="hint", stages=P, chunks=2, microbatches=M, hint=hint)
    trace = generate(scenario="none", stages=P, microbatches=M, chunks=2, seed=0)
    assert simulate(policy=policy, trace=trace, cap=Cap.parse("inf")).makespan_ms > 0


@pytest.mark.parametrize("text", ['{"0": ["0F0", "1B3c1"]}', '{"0": ["0F0", "0B0", "0W0"], "1": []}'])
def test_the_stage_and_chunk_notation_is_refused_pointing_at_its_table(text: str) -> None:
    with pytest.raises(ValueError, match="stage-and-chunk.*docs/policies.md, section 'Action notation'"):
        parse_order(read_hint(text), stages=2, chunks=1, microbatches=1)


def test_a_hint_naming_a_foreign_action_or_deadlocking_prints_the_grid() -> None:
    with pytest.raises(ValueError, match=r"(?s)stage 0 lists 1F0.*>1F0<"):
        parse_order(read_hint("0F0,1F0,0B0\n1F0,1B0\n"), stages=2, chunks=1, microbatches=1)
    with pytest.raises(ValueError, match=r"(?s)deadlock.*>"):
        parse_order(read_hint("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n"), stages=2, chunks=1, microbatches=2)
