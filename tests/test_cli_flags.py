"""The jobs' flags come from the config models: a field's type, default and description make its flag."""

from __future__ import annotations

import argparse

import pytest
from pydantic import BaseModel, Field

from rrfp_ray.cli import Flag, add_flags, flag_names, flag_values, model_flags
from rrfp_ray.recipes.gpt_cli import FLAGS, PIPELINE
from rrfp_ray.train.config import SECTION_OF


class Inner(BaseModel):
    width: int = Field(8, description="how wide")
    rate: float = Field(0.5)
    fused: bool = Field(True, description="fuse the kernels")
    mode: str | None = Field(None, description="the mode")


class Outer(BaseModel):
    inner: Inner = Field(default_factory=Inner)


def parser_of(flags) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, model=Outer, flags=flags)
    return parser


def test_a_field_becomes_a_flag_with_its_type_default_and_description():
    flags = model_flags(Inner, prefix="inner.", flags=(Flag("fused", "--no-fuse", negate=True),))
    assert [flag.name for flag in flags] == ["--width", "--rate", "--no-fuse", "--mode"]
    parser = parser_of(flags)
    help = parser.format_help()
    assert "how wide (default 8)" in help and "turn off: fuse the kernels" in help
    args = parser.parse_args(["--width", "3", "--no-fuse"])
    assert flag_values(args, flags=flags) == {"inner": {"width": 3, "rate": 0.5, "fused": False, "mode": None}}
    assert Outer(**flag_values(args, flags=flags)).inner == Inner(width=3, fused=False)
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--width", "wide"])


def test_a_job_default_and_spelling_are_its_own():
    flags = model_flags(Inner, prefix="inner.", without=("fused",), flags=(Flag("width", "--w", default=2),))
    args = parser_of(flags).parse_args([])
    assert (args.w, args.rate) == (2, 0.5)
    assert flag_names(flags)["inner.width"] == "--w"


def test_a_switch_must_turn_a_field_from_its_default():
    with pytest.raises(ValueError, match="--fused"):
        parser_of(model_flags(Inner, prefix="inner."))


def test_an_unknown_field_is_refused():
    with pytest.raises(ValueError, match="no fields"):
        model_flags(Inner, without=("depth",))


def test_every_pipeline_field_is_a_train_gpt_flag_but_the_two_left_out():
    fields = {flag.field.rsplit(".", 1)[1] for flag in PIPELINE}
    assert set(SECTION_OF) - fields == {"buffer_limit", "link_timeout_s"}
    assert all(FLAGS[flag.field] == FLAGS[flag.alias] == flag.name for flag in PIPELINE)
    assert FLAGS["pipeline.shape.stages"] == FLAGS["pipeline.stages"] == "--stages"
