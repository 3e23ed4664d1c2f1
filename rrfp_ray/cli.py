"""What the job scripts share: flags made from the config models' fields, scenario and log-level
flags, config errors as flag errors, and pictures."""

from __future__ import annotations

import argparse
import enum
import logging
import os
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from rrfp_ray.installed import missing_extra
from rrfp_ray.policy.policy import Policy
from rrfp_ray.schedule.actions import Placement
from rrfp_ray.sim.variability import SCENARIOS, scenario_params

_MODEL_DEFAULT: Any = object()


@dataclass(frozen=True)
class Flag:
    """A command-line flag that sets one field of a config model: its type, default and help are
    the field's unless the job gives its own."""

    field: str  # dotted path from the job's model, e.g. "pipeline.stages"
    spelling: str = ""  # default: --<the field's name, dashes for underscores>
    default: Any = _MODEL_DEFAULT  # a job's own default, where it differs from the model's
    negate: bool = False  # a store_true flag that sets a bool field False (e.g. --no-overlap)
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    help: str = ""  # default: the field's description
    # a None default's meaning in the help, e.g. "4P" for "(default 4P)"
    default_note: str = ""
    # the job's own parse of the text, where it refuses more at once than the field's type (e.g. counts >= 1)
    parse: Callable[[str], Any] | None = None
    alias: str = ""  # the flat path a sectioned model also takes, e.g. "pipeline.stages" for "pipeline.shape.stages"

    @property
    def name(self) -> str:
        return self.spelling or "--" + self.field.rsplit(".", 1)[-1].replace("_", "-")

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")


def model_field(model: type[BaseModel], path: str) -> FieldInfo:
    """The field at dotted `path` below `model` (through its nested models)."""
    *parents, last = path.split(".")
    for part in parents:
        model = _optional(model.model_fields[part].annotation)
    return model.model_fields[last]


def _optional(annotation: Any) -> Any:
    """X for `X | None`, else the annotation."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def _as_text(value: Any) -> Any:
    """A model default as the flag's: numbers, text and None as they are, an enum's value, else its text."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return value.value if isinstance(value, enum.Enum) else str(value)


def add_flags(group: argparse._ActionsContainer, *, model: type[BaseModel], flags: Sequence[Flag]) -> None:
    """One flag per `Flag`: int and float fields parse as such, bool fields are store_true
    switches, every other field takes text that the model parses (an enum, a cap, a path)."""
    for flag in flags:
        info = model_field(model, flag.field)
        kind = _optional(info.annotation)
        help = flag.help or info.description or ""
        if kind is bool:
            if info.default is not flag.negate:
                raise ValueError(f"{flag.name}: a switch turns {flag.field} from its default {info.default}")
            group.add_argument(flag.name, action="store_true", help=f"turn off: {help}" if flag.negate else help)
            continue
        default = info.get_default(call_default_factory=True) if flag.default is _MODEL_DEFAULT else flag.default
        if default is not None:
            help = help.replace("%", "%%") + " (default %(default)s)"
        elif flag.default_note:
            help = f"{help} (default {flag.default_note})".replace("%", "%%")
        group.add_argument(
            flag.name,
            type=flag.parse or (kind if kind in (int, float) else None),
            default=_as_text(default),
            choices=flag.choices,
            metavar=flag.metavar,
            help=help,
        )


def flag_values(args: argparse.Namespace, *, flags: Sequence[Flag]) -> dict[str, Any]:
    """The fields `flags` set, nested as the model's: {"pipeline": {"stages": 4, ...}, ...}."""
    values: dict[str, Any] = {}
    for flag in flags:
        value = getattr(args, flag.dest)
        *parents, last = flag.field.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = not value if flag.negate else value
    return values


def flag_names(flags: Sequence[Flag]) -> dict[str, str]:
    """Field path (and its flat alias) -> the flag that sets it (`config_error` names flags with it)."""
    return {path: flag.name for flag in flags for path in (flag.field, flag.alias) if path}


def model_flags(
    model: type[BaseModel],
    *,
    prefix: str = "",
    without: Iterable[str] = (),
    only: Iterable[str] | None = None,
    flags: Sequence[Flag] = (),
) -> tuple[Flag, ...]:
    """A flag for every field of `model` (through its sections: fields that are models) but those
    `without` (or for those `only`), in the model's order, at `prefix` (e.g. "pipeline."); `flags`
    declare the fields whose flag is not the field's own name, default or help (by field name,
    sections left out)."""
    paths = _field_paths(model, prefix=prefix)
    dropped = set(without) if only is None else set(paths) - set(only)
    own = {flag.field: flag for flag in flags if flag.field not in dropped}
    unknown = (set(without) | set(only or ()) | set(own)) - set(paths)
    if unknown:
        raise ValueError(f"{model.__name__} has no fields {sorted(unknown)}")
    return tuple(
        replace(own.get(name, Flag(name)), field=path, alias=alias)
        for name, (path, alias) in paths.items()
        if name not in dropped
    )


def _field_paths(model: type[BaseModel], *, prefix: str) -> dict[str, tuple[str, str]]:
    """Field name -> (its dotted path, its flat alias or ""), a section's fields in its place."""
    paths = {}
    for name, info in model.model_fields.items():
        kind = _optional(info.annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            paths |= {leaf: (f"{prefix}{name}.{leaf}", prefix + leaf) for leaf in kind.model_fields}
        else:
            paths[name] = (prefix + name, "")
    return paths


# How the jobs spell the `PipelineConfig` fields whose flag is not the field's name.
PIPELINE_FLAGS = (
    Flag("hint", help='a file: JSON {stage: ["0F0", ...]} or torch\'s CSV schedule, for policies hint/ready-hint'),
    Flag("dp_overlap", "--no-overlap", negate=True),
    Flag("zero", choices=(0, 1)),
    Flag("timeout_s", "--timeout"),
    Flag("layer_split", "--split", metavar="N,N,..."),
)


# How the jobs spell the `VariabilityConfig` fields whose flag is not the field's name.
VARIABILITY_FLAGS = {
    "seed": Flag("seed", "--variability-seed"),
    "trace_file": Flag("trace_file", "--trace", metavar="FILE"),
    "slow_devices": Flag("slow_devices", "--slow-device", default=None, metavar="STAGE:FACTOR,..."),
}


def scenario_flags(*, slow_devices: bool = False, **defaults: Any) -> tuple[Flag, ...]:
    """The `VariabilityConfig` flags, --slow-device among them for a job whose stages compute for real
    (`slow_devices`); `defaults` (field -> value) are a job's own, e.g. scenario="multimodal"."""
    from rrfp_ray.train.config import VariabilityConfig

    own = [replace(VARIABILITY_FLAGS.get(name, Flag(name)), default=value) for name, value in defaults.items()]
    without = ("params",) if slow_devices else ("params", "slow_devices")
    return model_flags(VariabilityConfig, without=without, flags=[*VARIABILITY_FLAGS.values(), *own])


def add_scenario_flags(parser: argparse.ArgumentParser, *, flags: Sequence[Flag] | None = None) -> None:
    """The `scenario_flags` (default: the model's defaults) and one flag per scenario parameter."""
    from rrfp_ray.train.config import VariabilityConfig

    group = parser.add_argument_group("variability (durations in ms)")
    add_flags(group, model=VariabilityConfig, flags=scenario_flags() if flags is None else flags)
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


def variability(args: argparse.Namespace, *, flags: Sequence[Flag] | None = None) -> dict[str, Any]:
    """The `VariabilityConfig` fields that `add_scenario_flags(flags=flags)` set."""
    return {**flag_values(args, flags=scenario_flags() if flags is None else flags), "params": scenario_kwargs(args)}


def baseline_policy(*, chunks: int, placement: Placement = Placement.LOOPED) -> str:
    """The fixed schedule a run's policies are compared with: 1f1b, interleaved when v > 1, zbv on the V placement."""
    if placement is Placement.V:
        return "zbv"
    return "1f1b" if chunks == 1 else "interleaved"


def equal_memory_baselines(*, chunks: int, placement: Placement = Placement.LOOPED) -> tuple[str, ...]:
    """The fixed schedules a run at cap 1x is compared with at equal activation memory: those holding 1F1B's
    peak per stage, with the fused backward and with the split (1f1b and zb-h1; interleaved and zb-interleaved
    when v > 1; zbv on the V placement). gpipe holds every microbatch in flight, so it is not among them."""
    if placement is Placement.V:
        return ("zbv",)
    return ("1f1b", "zb-h1") if chunks == 1 else ("interleaved", "zb-interleaved")


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


def write_pictures(*, out: Path, runs: dict[str, list], pair: tuple[str, str] | None = None) -> bool:
    """A Perfetto trace per run; with matplotlib (the `plots` extra), a pipeline diagram per run and one
    comparison diagram of the runs `pair` names (default: the two runs when there are two), else one line
    saying the diagrams were skipped. Whether it drew them."""
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
    if pair is None and len(runs) == 2:
        pair = (*runs,)
    if pair is not None:
        top, bottom = (median_report(runs[name]) for name in pair)
        compare_png(out / "compare.png", top, bottom)
    return True


def count(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 1, e.g. --stages 8,16,32."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be integers >= 1, got {text!r}")
    return values


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
