"""Schedules against PyTorch's own orders, and the order validator."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from rrfp_ray.schedule.actions import Action, Kind, Placement, parse_action
from rrfp_ray.schedule.generators import SCHEDULES, build, peak_inflight, peak_inflight_fb, splits
from rrfp_ray.schedule.layout import Layout
from rrfp_ray.schedule.validate import format_grid, unit_steps, validate

_KINDS = {"F": Kind.F, "B": Kind.B, "I": Kind.I, "W": Kind.W}


class _FakeStage:
    """What PyTorch's schedule constructors read from a stage, and what its single-stage runtime calls.

    ``is_last`` stays False so that the runtime keeps no loss; compute calls are recorded.
    """

    def __init__(self, *, rank: int, ranks: int, chunk: int = 0, chunks: int = 1) -> None:
        self.group_rank = rank
        self.group_size = ranks
        self.stage_index = chunk * ranks + rank
        self.num_stages = chunks * ranks
        self.is_last = False
        self.submod = None
        self.ran: list[Action] = []

    def forward_one_chunk(self, microbatch: int, *args: object, **kwargs: object) -> None:
        self._record(kind=Kind.F, microbatch=microbatch)

    def backward_one_chunk(self, microbatch: int, **kwargs: object) -> None:
        self._record(kind=Kind.B, microbatch=microbatch)

    def _record(self, *, kind: Kind, microbatch: int) -> None:
        action = Placement.LOOPED.action(
            kind=kind, virtual_stage=self.stage_index, microbatch=microbatch, stages=self.group_size
        )
        self.ran.append(action)

    def get_fwd_recv_ops(self, microbatch: int) -> list[object]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def perform_reduce_grad(self, scale: int) -> None:
        pass


def _compute_only(pipeline_order: dict[int, list], *, stages: int) -> dict[int, list[Action]]:
    """PyTorch's schedule IR with idle slots and communication dropped, in our actions."""
    order = {}
    for rank, actions in pipeline_order.items():
        order[rank] = []
        for action in actions:
            if action is None or action.computation_type.value not in _KINDS:
                continue
            kind = _KINDS[action.computation_type.value]
            vs, microbatch = action.stage_index, action.microbatch_index
            order[rank].append(
                Placement.LOOPED.action(kind=kind, virtual_stage=vs, microbatch=microbatch, stages=stages)
            )
    return order


def _torch_single(cls: type, *, stages: int, microbatches: int) -> tuple[dict[int, list[Action]], dict[int, list]]:
    """What each rank's single-stage PyTorch schedule runs (recorded), and its printed IR."""
    ran = {}
    for rank in range(stages):
        stage = _FakeStage(rank=rank, ranks=stages)
        schedule = cls(stage, microbatches)
        schedule._stage_forward_initialized = True  # skip shape inference, which needs real tensors
        schedule._step_microbatches()
        ran[rank] = stage.ran
    return ran, _compute_only(schedule.pipeline_order, stages=stages)


def _torch_multi(cls: type, *, stages: int, chunks: int, microbatches: int) -> dict[int, list[Action]]:
    fake = [_FakeStage(rank=0, ranks=stages, chunk=c, chunks=chunks) for c in range(chunks)]
    return _compute_only(cls(fake, microbatches).pipeline_order, stages=stages)


def _torch_order(name: str, *, stages: int, chunks: int, microbatches: int) -> dict[int, list[Action]]:
    if name == "gpipe":
        ran, ir = _torch_single(torch_schedules.ScheduleGPipe, stages=stages, microbatches=microbatches)
        assert ir == ran
        return ran
    if name == "1f1b":
        ran, ir = _torch_single(torch_schedules.Schedule1F1B, stages=stages, microbatches=microbatches)
        # Schedule1F1B's printed IR numbers the last rank's forwards from 1 (1..M): compare what it runs.
        assert {r: ir[r] for r in range(stages - 1)} == {r: ran[r] for r in range(stages - 1)}
        return ran
    if name == "interleaved":
        cls = torch_schedules.ScheduleInterleaved1F1B
    else:
        cls = torch_schedules.ScheduleInterleavedZeroBubble  # with one stage per rank: ZB-H1
    return _torch_multi(cls, stages=stages, chunks=chunks, microbatches=microbatches)


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for stages in range(2, 7):
        for microbatches in sorted({1, stages - 1, stages, stages + 1, 2 * stages, 2 * stages + 1, 3 * stages}):
            cases += [(name, stages, 1, microbatches) for name in ("gpipe", "1f1b", "zb-h1")]
            cases += [("interleaved", stages, chunks, microbatches) for chunks in (2, 3)]
    return cases


GRID = _grid()


def _id(case: tuple[str, int, int, int]) -> str:
    name, stages, chunks, microbatches = case
    return f"{name}-P{stages}-v{chunks}-M{microbatches}"


def _layout(name: str, stages: int, chunks: int, microbatches: int) -> Layout:
    return Layout(stages=stages, chunks=chunks, microbatches=microbatches, split=splits(name))


def _order(text: dict[int, str], *, stages: int = 2) -> dict[int, list[Action]]:
    return {stage: [parse_action(word, stages=stages) for word in line.split()] for stage, line in text.items()}


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_orders_equal_pytorch_and_refuse_what_pytorch_refuses(case: tuple[str, int, int, int]) -> None:
    name, stages, chunks, microbatches = case
    try:
        expected = _torch_order(name, stages=stages, chunks=chunks, microbatches=microbatches)
    except ValueError:
        with pytest.raises(ValueError, match="microbatches"):
            build(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
        return
    assert build(name=name, stages=stages, chunks=chunks, microbatches=microbatches) == expected


def test_the_grid_covers_refused_and_fewer_microbatches_than_stages() -> None:
    refused = {name for name, stages, chunks, m in GRID if name == "1f1b" and m < stages}
    uneven = [(s, m) for name, s, _, m in GRID if name == "interleaved" and m % max(1, m // s) != 0]
    few = {name for name, stages, chunks, m in GRID if m < stages and name != "1f1b"}
    assert refused == {"1f1b"} and uneven and few == {"gpipe", "zb-h1", "interleaved"}


def _refusal(name: str, stages: int, microbatches: int) -> str | None:
    """What `build` must say when it refuses a grid cell, by PyTorch's rules; None: it builds the cell."""
    rounds = max(1, microbatches // stages)
    if name == "1f1b" and microbatches < stages:
        return (
            f"microbatches must be >= stages for 1f1b (as PyTorch's Schedule1F1B requires), "
            f"got microbatches={microbatches} < stages={stages}"
        )
    if name in ("zb-h1", "interleaved") and microbatches % rounds != 0:
        return (
            f"microbatches must be a multiple of the number of rounds max(1, microbatches // stages) = {rounds} for "
            f"{name} (as PyTorch requires), got microbatches={microbatches} with stages={stages}"
        )
    return None


@pytest.mark.parametrize("case", GRID, ids=_id)
def test_every_generated_order_validates(case: tuple[str, int, int, int]) -> None:
    """Every cell either builds an order that validates or is refused with the message its rule gives."""
    name, stages, chunks, microbatches = case
    refusal = _refusal(name, stages, microbatches)
    if refusal is not None:
        with pytest.raises(ValueError) as refused:
            build(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
        assert str(refused.value) == refusal
        return
    validate(build(name=name, stages=stages, chunks=chunks, microbatches=microbatches), layout=_layout(*case))


def test_the_grid_holds_cells_of_each_refusal() -> None:
    refused = {name for name, stages, _, microbatches in GRID if _refusal(name, stages, microbatches)}
    assert refused == {"1f1b", "zb-h1", "interleaved"}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (5, 10), (3, 9)])
def test_unit_time_makespan_has_the_textbook_bubble(name: str, stages: int, microbatches: int) -> None:
    chunks = 2 if name == "interleaved" else 1
    layout = _layout(name, stages, chunks, microbatches)
    order = build(name=name, stages=stages, chunks=chunks, microbatches=microbatches)
    makespan = 1 + max(step for row in unit_steps(order, layout=layout).values() for step in row)
    work = len(layout.actions(stage=0))
    # GPipe and 1F1B idle 2(P-1) full-stage steps; interleaving shrinks each step to one chunk;
    # ZB-H1 fills half the drain with W.
    assert makespan - work == (stages - 1 if name == "zb-h1" else 2 * (stages - 1))


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (4, 4), (4, 8), (3, 9), (6, 12)])
def test_peak_inflight(stages: int, microbatches: int) -> None:
    one_f_one_b = build(name="1f1b", stages=stages, chunks=1, microbatches=microbatches)
    gpipe = build(name="gpipe", stages=stages, chunks=1, microbatches=microbatches)
    zb = build(name="zb-h1", stages=stages, chunks=1, microbatches=microbatches)
    for s in range(stages):
        assert peak_inflight(one_f_one_b, stage=s) == peak_inflight_fb(one_f_one_b, stage=s) == stages - s
        assert peak_inflight(gpipe, stage=s) == microbatches
        assert peak_inflight_fb(zb, stage=s) == stages - s
        assert peak_inflight(zb, stage=s) == stages  # each W waits s backwards longer
    with pytest.raises(ValueError, match="stage 9"):
        peak_inflight(gpipe, stage=9)


TWICE = [(stages, m) for stages in range(2, 7) for m in sorted({1, stages - 1, stages, 2 * stages, 4 * stages + 1})]


@pytest.mark.parametrize("name", ["1f1b-2x", "zb-h2"])
@pytest.mark.parametrize("stages,microbatches", TWICE)
def test_twice_the_memory_schedules_hold_every_action_once_and_validate(name: str, stages: int, microbatches: int):
    order = build(name=name, stages=stages, chunks=1, microbatches=microbatches)
    layout = _layout(name, stages, 1, microbatches)
    for s in range(stages):
        assert sorted(map(str, order[s])) == sorted(map(str, layout.actions(stage=s)))
    validate(order, layout=layout)


@pytest.mark.parametrize("stages,microbatches", [(2, 8), (4, 16), (5, 10), (8, 32)])
def test_twice_the_memory_schedules_hold_twice_1f1b_and_no_more(stages: int, microbatches: int) -> None:
    doubled = build(name="1f1b-2x", stages=stages, chunks=1, microbatches=microbatches)
    h2 = build(name="zb-h2", stages=stages, chunks=1, microbatches=microbatches)
    for s in range(stages):
        forwards_first = next(i for i, a in enumerate(doubled[s]) if a.kind is Kind.B)
        assert forwards_first == min(2 * (stages - s), microbatches)
        assert peak_inflight(doubled, stage=s) == 2 * (stages - s)
        assert peak_inflight_fb(h2, stage=s) == 2 * (stages - s) - 1  # F before the first I: the paper's warmup
        assert peak_inflight(h2, stage=s) == 2 * stages - 1 - s  # each W s input gradients late, as zb-h1
    assert max(peak_inflight(h2, stage=s) for s in range(stages)) == 2 * stages - 1  # (2p-1) M_B <= 2x 1F1B's p


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (5, 10), (3, 9)])
def test_at_unit_times_zb_h2_has_zb_h1s_bubble_and_1f1b_2x_has_1f1bs(stages: int, microbatches: int) -> None:
    def bubble(name: str) -> int:
        layout = _layout(name, stages, 1, microbatches)
        order = build(name=name, stages=stages, chunks=1, microbatches=microbatches)
        makespan = 1 + max(step for row in unit_steps(order, layout=layout).values() for step in row)
        return makespan - len(layout.actions(stage=0))

    # P-1 is the least with one step for every stage: the last stage cannot start before step P-1.
    assert bubble("zb-h2") == bubble("zb-h1") == stages - 1
    assert bubble("1f1b-2x") == bubble("1f1b") == 2 * (stages - 1)


def test_peak_inflight_counts_chunk_zero_only() -> None:
    order = _order({0: "0F0 1F0 0F1 1F1 1B0 0B0 1B1 0B1"}, stages=1)  # one stage, two chunks
    assert peak_inflight(order, stage=0) == 2
    assert peak_inflight(_order({0: "0F0 0B0 0F1 0B1"}, stages=1), stage=0) == 1


def test_names_and_splits() -> None:
    assert list(SCHEDULES) == [
        "gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "1f1b-2x", "zb-h2", "zb-interleaved", "zbv", "dualpipev"
    ]  # fmt: skip
    assert [splits(name) for name in SCHEDULES] == [False, False, False, False, True, False, True, True, True, True]
    assert any(a.kind is Kind.W for a in build(name="zb-h1", stages=2, chunks=1, microbatches=2)[0])
    with pytest.raises(ValueError, match=r"unknown schedule name 'x'; known: gpipe"):
        splits("x")


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(name="pipedream", stages=2, chunks=1, microbatches=4), "name"),
        (dict(name="interleaved", stages=2, chunks=1, microbatches=4), "chunks"),
        (dict(name="gpipe", stages=2, chunks=2, microbatches=4), "chunks"),
        (dict(name="zb-h1", stages=2, chunks=3, microbatches=4), "chunks"),
        (dict(name="1f1b", stages=4, chunks=1, microbatches=3), "microbatches"),
        (dict(name="interleaved", stages=4, chunks=2, microbatches=9), "microbatches"),
        (dict(name="zb-h1", stages=4, chunks=1, microbatches=9), "microbatches"),
        (dict(name="gpipe", stages=0, chunks=1, microbatches=4), "stages"),
        (dict(name="gpipe", stages=2, chunks=1, microbatches=0), "microbatches"),
    ],
)
def test_build_errors_name_the_argument(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as error:
        build(**kwargs)
    if field == "name":
        known = "gpipe, 1f1b, interleaved, looped-bfs, zb-h1, 1f1b-2x, zb-h2, zb-interleaved, zbv, dualpipev"
        assert known in str(error.value)


def _error(order: dict[int, list[Action]], layout: Layout) -> str:
    with pytest.raises(ValueError) as error:
        validate(order, layout=layout)
    return str(error.value)


def _two_stages() -> tuple[dict[int, list[Action]], Layout]:
    return build(name="1f1b", stages=2, chunks=1, microbatches=3), Layout(stages=2, chunks=1, microbatches=3)


def test_missing_action() -> None:
    order, layout = _two_stages()
    order[1].remove(parse_action("1B2", stages=2))
    message = _error(order, layout)
    assert "stage 1 never runs 1B2" in message
    assert "stage 0  0F0  0F1  0B0" in message and message.endswith("stage 1  1F0  1B0  1F1  1B1  1F2")


def test_duplicated_action_marks_the_second_copy() -> None:
    order, layout = _two_stages()
    order[0].insert(3, parse_action("0F1", stages=2))
    message = _error(order, layout)
    assert "stage 0 lists 0F1 twice (positions 1 and 3)" in message
    assert "stage 0  0F0  0F1  0B0  >0F1<  0F2" in message


@pytest.mark.parametrize(
    "text,layout,expected",
    [
        (
            {0: "0F0 0F1 0B0 0B1", 1: "1F0 1F1 1B0 0B1"},
            Layout(stages=2, chunks=1, microbatches=2),
            "stage 1 lists 0B1, which belongs to stage 0",
        ),
        (
            {0: "0F0 0F1 0B0 0B1 0W1", 1: "1F0 1F1 1B0 1B1"},
            Layout(stages=2, chunks=1, microbatches=2),
            "does not split B",
        ),
        (
            {0: "0F0 0F1 0B0 0B1 0F2", 1: "1F0 1F1 1B0 1B1"},
            Layout(stages=2, chunks=1, microbatches=2),
            "0F2, which is out of range",
        ),
    ],
)
def test_foreign_action(text: dict[int, str], layout: Layout, expected: str) -> None:
    message = _error(_order(text), layout)
    assert expected in message and ">" in message


def test_missing_and_foreign_stages() -> None:
    layout = Layout(stages=2, chunks=1, microbatches=1)
    assert "stage 1 has no list" in _error(_order({0: "0F0 0B0"}), layout)
    assert "stage 2 is not a stage" in _error(_order({0: "0F0 0B0", 1: "1F0 1B0", 2: ""}), layout)


def test_backward_before_its_forward() -> None:
    order, layout = _two_stages()
    order[1] = _order({1: "1F0 1B1 1B0 1F1 1F2 1B2"})[1]
    message = _error(order, layout)
    assert "1B1 waits for 1F1 on the same stage" in message
    assert "stage 1  1F0  >1B1<  1B0" in message


def test_weight_before_its_backward() -> None:
    order = build(name="zb-h1", stages=2, chunks=1, microbatches=2)
    order[0] = _order({0: "0F0 0F1 0W0 0I0 0I1 0W1"})[0]
    assert ">0W0<" in _error(order, Layout(stages=2, chunks=1, microbatches=2, split=True))


def test_cross_stage_deadlock_prints_the_unit_time_grid() -> None:
    # Stage 0 runs B0 before F1 while stage 1 wants F1 before B0: each waits for the other.
    order = _order({0: "0F0 0B0 0F1 0B1", 1: "1F0 1F1 1B0 1B1"})
    message = _error(order, Layout(stages=2, chunks=1, microbatches=2))
    assert message == (
        "invalid pipeline order: deadlock at step 2: "
        "0B0 waits for the gradient from 1B0, which stage 1 runs only after 1F1; "
        "1F1 waits for the activation from 0F1, which stage 0 runs only after 0B0\n"
        "\n"
        "order at unit times:\n"
        "step     0    1    2\n"
        "stage 0  0F0       >0B0<\n"
        "stage 1       1F0  >1F1<"
    )


def test_deadlock_through_the_wrap_link() -> None:
    layout = Layout(stages=2, chunks=2, microbatches=2)
    order = build(name="interleaved", stages=2, chunks=2, microbatches=2)
    order[0].remove(parse_action("2F0", stages=2))
    order[0].insert(0, parse_action("2F0", stages=2))
    message = _error(order, layout)
    assert "2F0 waits for the activation from 1F0" in message
    assert "1F0 waits for the activation from 0F0, which stage 0 runs only after 2F0" in message
    assert "stage 0  >2F0<" in message and "stage 1  >1F0<" in message


def test_deadlock_marks_only_the_wait_cycle() -> None:
    # Stages 0 and 1 wait on each other; stage 2 merely waits for stage 1's activations.
    order = build(name="1f1b", stages=3, chunks=1, microbatches=3)
    order[1] = _order({1: "1F0 1B0 1F1 1F2 1B1 1B2"}, stages=3)[1]
    order[0] = _order({0: "0F0 0F1 0B0 0B1 0F2 0B2"}, stages=3)[0]
    message = _error(order, Layout(stages=3, chunks=1, microbatches=3))
    assert "deadlock at step 8: 0B1 waits" in message and "1F2 waits" in message and "2F2" not in message
    rows = {line[:7]: line for line in message.splitlines() if line.startswith("stage")}
    assert rows["stage 0"].endswith(">0B1<") and rows["stage 1"].endswith(">1F2<") and ">" not in rows["stage 2"]


def test_format_grid_places_actions_at_given_steps() -> None:
    order = _order({0: "0F0 0B0", 1: "1F0 1B0"})
    assert format_grid(order, columns={0: [0, 3], 1: [1, 2]}, marks={(1, 1)}) == (
        "step     0    1    2      3\nstage 0  0F0              0B0\nstage 1       1F0  >1B0<"
    )
    assert format_grid(order).splitlines()[0] == "pos      0    1"
