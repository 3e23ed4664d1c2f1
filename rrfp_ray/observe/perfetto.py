"""Chrome / Perfetto trace-event JSON of iteration reports (open in ui.perfetto.dev or chrome://tracing).

One process per stage (pid = stage). Its tracks: compute, one complete event per op, named by
the op's compact form; blocked, the gaps between ops within the stage's wall time; and send /
recv, only when such spans are given (reports do not carry them). Iterations follow one another
on the time axis: at their real start when every stage recorded one (the runtime), else back to
back by makespan (the simulator).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path

from rrfp_ray.observe.telemetry import IterationReport, OpEvent, StageStats
from rrfp_ray.schedule.actions import action_kind

COMPUTE, BLOCKED, SEND, RECV = 0, 1, 2, 3
TRACK_NAMES = {COMPUTE: "compute", BLOCKED: "blocked", SEND: "send", RECV: "recv"}
_MIN_GAP_MS = 1e-6  # gaps shorter than this are float rounding, not blocked time


def stage_window(report: IterationReport, *, stage: int) -> tuple[float, float]:
    """Where a stage's wall time lies on the report's clock, in ms (runtime stages start apart)."""
    stats = _stats(report, stage=stage)
    start = (stats.started_at - min(s.started_at for s in report.stages)) * 1e3
    return start, start + stats.wall_ms


def blocked_spans(report: IterationReport, *, stage: int) -> list[tuple[float, float]]:
    """(start_ms, end_ms) of every gap between the stage's ops within its wall time."""
    start, end = stage_window(report, stage=stage)
    spans, cursor = [], start
    for event in sorted((e for e in report.events if e.stage == stage), key=lambda e: e.start_ms):
        if event.start_ms - cursor > _MIN_GAP_MS:
            spans.append((cursor, event.start_ms))
        cursor = max(cursor, event.end_ms)
    if end - cursor > _MIN_GAP_MS:
        spans.append((cursor, end))
    return spans


def chrome_trace(
    reports: list[IterationReport],
    *,
    send_events: Sequence[Sequence[OpEvent]] | None = None,
    recv_events: Sequence[Sequence[OpEvent]] | None = None,
) -> dict:
    """The trace of `reports`, in order.

    `send_events` / `recv_events`, when given, hold one list per report of transfer spans on that
    report's clock: `action` names the op whose output is sent (send) or whose input arrives (recv).
    Compute events carry `ready_ms` on their iteration's own clock, as the report does.
    """
    if not reports:
        raise ValueError("reports: need at least one IterationReport")
    sends = _per_report(send_events, name="send_events", count=len(reports))
    recvs = _per_report(recv_events, name="recv_events", count=len(reports))
    for report in reports:
        _check(report)
    events: list[dict] = []
    for report, offset, send, recv in zip(reports, _offsets(reports), sends, recvs):
        events += _iteration_events(report, offset_ms=offset, transfers={SEND: send, RECV: recv})
    tracks = {(e["pid"], e["tid"]) for e in events}
    return {"traceEvents": _metadata(reports, tracks=tracks) + events, "displayTimeUnit": "ms"}


def write_trace(
    path: str | Path,
    reports: list[IterationReport],
    *,
    send_events: Sequence[Sequence[OpEvent]] | None = None,
    recv_events: Sequence[Sequence[OpEvent]] | None = None,
) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(reports, send_events=send_events, recv_events=recv_events)))
    return path


def _stats(report: IterationReport, *, stage: int) -> StageStats:
    for stats in report.stages:
        if stats.stage == stage:
            return stats
    raise ValueError(f"report {report.iteration}: stages has no StageStats for stage {stage}")


def _per_report(spans: Sequence[Sequence[OpEvent]] | None, *, name: str, count: int) -> Sequence[Sequence[OpEvent]]:
    if spans is None:
        return [()] * count
    if len(spans) != count:
        raise ValueError(f"{name}: need one list per report, got {len(spans)} for {count} reports")
    return spans


def _iteration_events(
    report: IterationReport, *, offset_ms: float, transfers: dict[int, Sequence[OpEvent]]
) -> list[dict]:
    events = [_compute_event(e) for e in report.events]
    for stats in report.stages:
        for start, end in blocked_spans(report, stage=stats.stage):
            events.append(
                _span(name="blocked", cat="blocked", pid=stats.stage, tid=BLOCKED, start_ms=start, end_ms=end)
            )
    for tid, spans in transfers.items():
        for span in spans:
            events.append(
                _span(
                    name=span.action,
                    cat=TRACK_NAMES[tid],
                    pid=span.stage,
                    tid=tid,
                    start_ms=span.start_ms,
                    end_ms=span.end_ms,
                )
            )
    for event in events:
        event["ts"] += offset_ms * 1e3
        event["args"]["iteration"] = report.iteration
    return events


def _check(report: IterationReport) -> None:
    known = {s.stage for s in report.stages}
    if not known:
        raise ValueError(f"report {report.iteration}: stages is empty")
    strays = sorted({e.stage for e in report.events} - known)
    if strays:
        raise ValueError(f"report {report.iteration}: events on stages {strays} that have no StageStats")


def _offsets(reports: list[IterationReport]) -> list[float]:
    starts = [min(s.started_at for s in r.stages) for r in reports]
    if all(s.started_at > 0 for r in reports for s in r.stages):
        return [(start - min(starts)) * 1e3 for start in starts]
    return list(itertools.accumulate((r.makespan_ms for r in reports[:-1]), initial=0.0))


def _compute_event(event: OpEvent) -> dict:
    kind = action_kind(event.action).value
    trace_event = _span(
        name=event.action, cat=kind, pid=event.stage, tid=COMPUTE, start_ms=event.start_ms, end_ms=event.end_ms
    )
    trace_event["args"].update(
        hint_pos=event.hint_pos,
        overtook=event.overtook,
        ready_ms=event.ready_ms,
        waited_ms=event.start_ms - event.ready_ms,
    )
    return trace_event


def _span(*, name: str, cat: str, pid: int, tid: int, start_ms: float, end_ms: float) -> dict:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": start_ms * 1e3,
        "dur": (end_ms - start_ms) * 1e3,
        "args": {},
    }


def _metadata(reports: list[IterationReport], *, tracks: set[tuple[int, int]]) -> list[dict]:
    stages = sorted({s.stage for r in reports for s in r.stages})
    meta = []
    for stage in stages:
        meta.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": stage, "args": {"sort_index": stage}})
    for stage, tid in sorted(tracks):
        meta.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": tid, "args": {"name": TRACK_NAMES[tid]}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": stage, "tid": tid, "args": {"sort_index": tid}})
    return meta
