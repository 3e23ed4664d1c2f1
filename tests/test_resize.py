"""The shape a job runs at when the cluster holds fewer actors than it asked for (rrfp_ray.train.resize)."""

from rrfp_ray.train.config import PipelineConfig
from rrfp_ray.train.resize import choose, shapes


def _numbers(pipeline: PipelineConfig) -> tuple[int, int, int, int, int]:
    return pipeline.dp, pipeline.stages, pipeline.tp, pipeline.microbatches, pipeline.chunks


def test_replicas_go_first_keeping_d_x_m_then_stages_down_to_one():
    target = PipelineConfig(dp=4, stages=3, microbatches=4, tp=2)
    found = [_numbers(s) for s in shapes(target=target)]
    # D 3 does not divide D x M = 16: skipped
    assert found == [(4, 3, 2, 4, 1), (2, 3, 2, 8, 1), (1, 3, 2, 16, 1), (1, 2, 2, 16, 1), (1, 1, 2, 16, 1)]
    assert all(s.global_microbatches == 16 for s in shapes(target=target))


def test_fewer_stages_spread_a_set_split_evenly_over_the_same_layers():
    target = PipelineConfig(stages=4, chunks=2, microbatches=8, layer_split=(3, 1, 1, 1, 1, 1, 1, 1))
    found = {s.stages: (s.chunks, s.layer_split) for s in shapes(target=target)}
    assert found == {
        4: (2, (3, 1, 1, 1, 1, 1, 1, 1)),
        3: (2, (2, 2, 2, 2, 1, 1)),
        2: (2, (3, 3, 2, 2)),
        1: (1, (10,)),  # one stage has one chunk
    }


def test_a_single_replica_runs_without_zero():
    target = PipelineConfig(dp=2, stages=2, microbatches=2, zero=1)
    assert [(s.dp, s.zero) for s in shapes(target=target)] == [(2, 1), (1, 0), (1, 0)]


def test_shapes_the_config_refuses_are_skipped():
    # a user hint is written for two stages: no other stage count can take it
    target = PipelineConfig(dp=2, stages=2, microbatches=1, policy="hint", hint={0: ["0F0", "0B0"], 1: ["1F0", "1B0"]})
    found = [_numbers(s) for s in shapes(target=target)]
    assert found == [(2, 2, 1, 1, 1)]  # D 1 would have M 2, which the hint does not cover either


def test_choose_takes_the_first_shape_that_fits_and_the_target_when_it_fits_again():
    target = PipelineConfig(dp=2, stages=4, microbatches=4)

    def fits(actors: int):
        return lambda shape: shape.actors <= actors

    assert _numbers(choose(target=target, placeable=fits(8))) == (2, 4, 1, 4, 1)
    assert _numbers(choose(target=target, placeable=fits(7))) == (1, 4, 1, 8, 1)
    assert _numbers(choose(target=target, placeable=fits(3))) == (1, 3, 1, 8, 1)
    assert _numbers(choose(target=target, placeable=fits(1))) == (1, 1, 1, 8, 1)
    assert choose(target=target, placeable=fits(0)) is None
