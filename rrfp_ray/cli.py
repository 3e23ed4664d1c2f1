"""What the job scripts share: scenario and log-level flags, config errors as flag errors, and pictures."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rrfp_ray.installed import missing_extra
from rrfp_ray.policy.pickers import Policy
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.sim.variability import SCENARIOS, scenario_params


def add_scenario_flags(parser: argparse.ArgumentParser, *, default: str = "none") -> None:
    group = parser.add_argument_group("variability (durations in ms)")
    group.add_argument("--scenario", default=default, help=f"'+'-joined names from: {', '.join(SCENARIOS)}")
    group.add_argument("--t-f", type=float, default=20.0, help="forward time per virtual stage (ms)")
    group.add_argument("--variability-seed", type=int, default=0, help="seed of the generated trace")
    group.add_argument("--trace", default=None, metavar="FILE", help="load this trace JSON instead of generating one")
    names = sorted({name for scenario in SCENARIOS for name in scenario_params(scenario)})
    for name in names:
        group.add_argument(f"--{name.replace('_', '-')}", type=float, default=None, help="scenario parameter")


LOG_LEVELS = ("debug", "info", "warning", "error")
LIBRARY_LOGGERS = ("rrfp_ray", "actors", "benchmarks")


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="show the library's log messages from this level up (info: placement, actor start, checkpoints, restarts)",
    )


def configure_logging(args: argparse.Namespace) -> str:
    """The library's loggers write to stderr from --log-level up (other libraries' stay at warning);
    returns the level's name, for the Ray workers (`actors.local_ray.start_ray(log_level=...)`)."""
    level = args.log_level.upper()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    return level


def scenario_kwargs(args: argparse.Namespace) -> dict[str, float]:
    names = {name for scenario in SCENARIOS for name in scenario_params(scenario)}
    return {name: getattr(args, name) for name in sorted(names) if getattr(args, name) is not None}


def variability(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "scenario": args.scenario,
        "seed": args.variability_seed,
        "t_f": args.t_f,
        "params": scenario_kwargs(args),
        "trace_file": args.trace,
    }


def baseline_policy(*, chunks: int, placement: Placement = Placement.LOOPED) -> str:
    """The fixed schedule a run's policies are compared with: 1f1b, interleaved when v > 1, zbv on the V placement."""
    if placement is Placement.V:
        return "zbv"
    return "1f1b" if chunks == 1 else "interleaved"


def one_placement(policies: Mapping[str, Policy]) -> Placement:
    """The placement every policy (name -> Policy) runs on; ValueError naming two that differ.

    One pipeline's stages, links and loss stage follow one placement, so its policies share it."""
    by_placement = {policy.placement: name for name, policy in policies.items()}
    if len(by_placement) > 1:
        v, looped = by_placement[Placement.V], by_placement[Placement.LOOPED]
        raise ValueError(
            f"{v} runs on the V placement and {looped} on the looped one; one pipeline runs policies of one "
            "placement (its links and loss stage follow it): measure them in separate runs"
        )
    return next(iter(by_placement), Placement.LOOPED)


def config_error(parser: argparse.ArgumentParser, error: ValidationError, *, flags: dict[str, str]) -> None:
    """Exit with the config's errors, each naming the flag that set the field."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        for name, flag in sorted(flags.items(), key=lambda kv: -len(kv[0])):
            message = message.replace(name, flag)
        lines.append(f"{flags.get(field, field) or 'config'}: {message}" if field else message)
    parser.error("\n  ".join(lines))


def median_report(reports: list):
    return sorted(reports, key=lambda r: r.makespan_ms)[len(reports) // 2]


def write_pictures(*, out: Path, runs: dict[str, list]) -> bool:
    """A Perfetto trace per run; with matplotlib (the `plots` extra), a pipeline diagram per run and one
    comparison diagram for two runs, else one line saying the diagrams were skipped. Whether it drew them."""
    from rrfp_ray.observe.diagram import compare_png, pipeline_png
    from rrfp_ray.observe.perfetto import write_trace

    out.mkdir(parents=True, exist_ok=True)
    for name, reports in runs.items():
        write_trace(out / f"trace-{name}.json", reports)
    missing = missing_extra("matplotlib", extra="plots")
    if missing:
        print(f"diagrams skipped: {missing}")
        return False
    for name, reports in runs.items():
        pipeline_png(out / f"pipeline-{name}.png", median_report(reports))
    if len(runs) == 2:
        top, bottom = (median_report(reports) for reports in runs.values())
        compare_png(out / "compare.png", top, bottom)
    return True


def writable_dir(parser: argparse.ArgumentParser, *, flag: str, path: str) -> None:
    """Create output directory `path` now, or fail naming `flag`: not after the run."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"argument {flag}: {path}: cannot create this directory ({error.strerror or error})")
    if not os.access(path, os.W_OK):
        parser.error(f"argument {flag}: {path}: this directory is not writable")


def file_dir(parser: argparse.ArgumentParser, *, flag: str, path: str) -> None:
    """Output file `path` must have a directory to go in, or fail naming `flag`."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        parser.error(f"argument {flag}: {path}: no directory {parent}")


def read_text(parser: argparse.ArgumentParser, *, flag: str, path: str) -> str:
    """An input file's text, or an error naming `flag`."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"argument {flag}: {path}: cannot read it ({getattr(error, 'strerror', None) or error})")
