"""Every job keeps its command line: each flag's spellings, default, type, choices and the config
field (its key in the run's JSON) it sets, as recorded in tests/data/job_flags.json.

After an intended change to a job's flags, rewrite the record and review its diff:
    PYTHONPATH=. python tests/test_job_flags.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "data" / "job_flags.json"
# Job module -> how to build its parser: the function called with an empty argv, or None for `main()` without one.
JOBS = {
    "bench_framing": "main",
    "bench_measure": "parse",
    "bench_peers": "main",
    "bench_plan_wait": "main",
    "bench_planner_cpu": "main",
    "bench_planning": "main",
    "bench_policies": None,
    "bench_rebalance": "main",
    "bench_runtime": "parse",
    "bench_simulator": None,
    "bench_suite": "parse",
    "bench_tp": None,
    "bench_vlm": "main",
    "bench_vlm_costs": "main",
    "bench_vlm_gil": "main",
    "bench_vlm_planner": "main",
    "dashboard_shots": "parse",
    "export": "main",
    "replay": "main",
    "results": "main",
    "simulate": "main",
    "soak": "main",
    "train_gpt": "parse",
    "train_vlm": "parse",
}


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


def job_parser(name: str, *, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser job `name` builds, caught at its parse_args (before any check or run)."""

    def caught(self: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        raise _Parsed(self)

    monkeypatch.syspath_prepend(str(ROOT / "jobs"))
    module = importlib.import_module(name)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    entry = JOBS[name]
    try:
        getattr(module, entry)([]) if entry else module.main()
    except _Parsed as parsed:
        return parsed.parser
    raise AssertionError(f"jobs/{name}.py returned without parsing its flags")


def _plain(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(str(ROOT), "<checkout>")  # a default under the checkout, wherever it is
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return getattr(value, "__name__", None) or repr(value)


def flags_of(parser: argparse.ArgumentParser, *, fields: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Per option (by its first spelling): its spellings, dest, default, type, choices, action
    and the config field it sets (`fields`: field -> flag, the job's own table)."""
    field_of: dict[str, str] = {}
    for field, flag in fields.items():
        field_of.setdefault(flag, field)  # a field's path before its flat alias
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        key = action.option_strings[0] if action.option_strings else action.dest
        found[key] = {
            "spellings": list(action.option_strings),
            "dest": action.dest,
            "default": _plain(action.default),
            "type": _plain(action.type),
            "choices": _plain(action.choices),
            "action": type(action).__name__,
            "nargs": _plain(action.nargs),
            "required": action.required,
            "field": field_of.get(key),
        }
    return found


def config_fields(name: str) -> dict[str, str]:
    """The job's table of config field -> flag, where it has one."""
    if name == "train_gpt":
        from rrfp_ray.recipes.gpt_cli import FLAGS
    elif name == "bench_runtime":
        from benchmarks.runtime import FLAGS
    else:
        return {}
    return {field: flag for field, flag in FLAGS.items() if flag.startswith("--")}


def current(*, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, dict[str, Any]]]:
    return {name: flags_of(job_parser(name, monkeypatch=monkeypatch), fields=config_fields(name)) for name in JOBS}


@pytest.fixture(scope="module")
def flags() -> dict[str, dict[str, dict[str, Any]]]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return current(monkeypatch=monkeypatch)


RECORDED = json.loads(RECORD.read_text()) if RECORD.exists() else {}


@pytest.mark.parametrize("job", sorted(RECORDED))
def test_every_recorded_flag_keeps_its_spelling_default_and_field(job: str, flags):
    recorded, now = RECORDED[job], flags[job]
    assert sorted(now) == sorted(recorded), f"jobs/{job}.py: flags added or gone"
    for flag, expected in recorded.items():
        assert now[flag] == expected, f"jobs/{job}.py {flag}"


def test_every_job_with_flags_is_recorded():
    jobs = {path.stem for path in (ROOT / "jobs").glob("*.py")}
    assert jobs == set(RECORDED) == set(JOBS)


def test_the_record_sees_a_changed_default(monkeypatch):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=4)
    before = flags_of(parser, fields={"pipeline.stages": "--stages"})
    parser.set_defaults(stages=5)
    assert flags_of(parser, fields={"pipeline.stages": "--stages"}) != before
    assert before["--stages"]["field"] == "pipeline.stages"


if __name__ == "__main__":
    with pytest.MonkeyPatch.context() as patch:
        RECORD.write_text(json.dumps(current(monkeypatch=patch), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORD}", file=sys.stderr)
