"""`PipelineConfig` in sections: flat keywords still build it and read back, the layout and the
hint are worked out once."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from rrfp_ray.policy.caps import Cap
from rrfp_ray.runtime.transport import LinkTransport
from rrfp_ray.train.config import SECTION_OF, PipelineConfig, ShapeConfig


def test_flat_keywords_land_in_their_sections_and_read_back():
    config = PipelineConfig(stages=2, microbatches=4, policy="1f1b", cap="1x", backend="tcp", dp=2, zero=1)
    assert config.shape == ShapeConfig(stages=2, chunks=1, microbatches=4)
    assert (config.stages, config.policy, config.cap, config.backend) == (
        2,
        "1f1b",
        Cap(multiple=1.0),
        LinkTransport.TCP,
    )
    assert (config.parallel.dp, config.zero, config.timeout_s) == (2, 1, 60.0)
    assert config == PipelineConfig(
        shape={"stages": 2, "microbatches": 4},
        schedule={"policy": "1f1b", "cap": "1x"},
        transport={"backend": "tcp"},
        parallel={"dp": 2, "zero": 1},
    )


def test_every_section_field_reads_flat_through_a_property_of_its_own():
    """Declared, so that static checkers see each flat name and its type."""
    config = PipelineConfig()
    for name, section in SECTION_OF.items():
        assert isinstance(getattr(PipelineConfig, name), property), name
        assert getattr(config, name) == getattr(getattr(config, section), name)
    with pytest.raises(AttributeError, match="no attribute 'stage'"):
        config.stage  # noqa: B018


def test_a_flat_keyword_joins_a_section_given_beside_it():
    config = PipelineConfig(shape=ShapeConfig(stages=4, chunks=2), microbatches=6)
    assert (config.stages, config.chunks, config.microbatches) == (4, 2, 6)


def test_errors_name_the_section_and_unknown_keywords_are_refused():
    with pytest.raises(ValidationError, match="shape.stages"):
        PipelineConfig(stages=0)
    with pytest.raises(ValidationError, match="stagez"):
        PipelineConfig(stagez=2)
    with pytest.raises(ValidationError, match="needs dp >= 2"):
        PipelineConfig(zero=1)


def test_replaced_checks_the_copy_again():
    config = PipelineConfig(stages=2, dp=2, zero=1)
    assert config.replaced(dp=1, zero=0).parallel.dp == 1
    assert config.replaced(dp=1, zero=0).stages == 2
    with pytest.raises(ValidationError, match="needs dp >= 2"):
        config.replaced(dp=1)


def test_the_layout_and_hint_are_parsed_once(monkeypatch):
    import rrfp_ray.train.config as module

    calls = []
    parse = module.parse_order

    def counted(*args, **kwargs):
        calls.append(1)
        return parse(*args, **kwargs)

    monkeypatch.setattr(module, "parse_order", counted)
    hint = {0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}
    config = PipelineConfig(stages=2, microbatches=2, policy="ready-hint", hint=hint)
    first = config.layout
    assert config.layout is first and config.resolved_policy("hint").fixed
    assert len(calls) == 1
    copy = pickle.loads(pickle.dumps(config))
    assert copy == config and copy.layout == first
    assert PipelineConfig(stages=2, microbatches=2, policy="ready-hint", hint=hint) == config  # layout not cached
    plain = PipelineConfig(stages=2)
    plain.layout  # noqa: B018
    assert plain == PipelineConfig(stages=2) and hash(plain) == hash(PipelineConfig(stages=2))
