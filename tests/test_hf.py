"""The Hugging Face example: a GPT-2 split by its blocks (dict boundaries: hidden states,
attention mask, position ids; tied embedding and head) trains exactly like a single-process
run of the same model, and its export loads into GPT2LMHeadModel."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is the optional extra `hf` (pip install 'rrfp-ray[hf]')")

import torch
from transformers import GPT2LMHeadModel

from examples import hf_causal_lm as hf
from rrfp_ray.models.gpt import lm_loss_sum
from rrfp_ray.train.data import PAD


def test_the_split_gpt2_trains_like_a_single_process_run_and_saves_with_save_pretrained(tmp_path):
    with hf.trainer(stages=1, policy="1f1b") as whole:
        single = [whole.step().loss for _ in range(3)]
    with hf.trainer(stages=3, policy="bfw") as split:
        assert [t.names for t in split.workload.ties] == [("0.wte.weight", "5.lm_head.weight")]
        losses = [split.step().loss for _ in range(3)]
        state = split.state_dict()
        following = split.step().loss
    assert losses == pytest.approx(single, rel=1e-5)
    assert losses[-1] < losses[0]

    model = hf.unsplit(state)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    model.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    source = hf.data(microbatches=4)
    sums, count = 0.0, 0
    with torch.no_grad():
        for index in range(4):
            x, y = source.microbatch(iteration=3, index=index)
            total, n = lm_loss_sum(loaded(x, attention_mask=(x != PAD).long()).logits, y)
            sums, count = sums + float(total), count + int(n)
    assert sums / count == pytest.approx(following, rel=1e-4)  # HF's own forward, the pipeline's weights


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_stage_materializes_only_its_own_gpt2_layers_with_the_seeded_whole_builds_weights(stage):
    from rrfp_ray.train.layers import model_layers

    layers = model_layers(model=hf.build, seed=0)
    whole = layers()
    built = layers.stage_layers(stages=3, chunks=1, stage=stage)
    own = range(2 * stage, 2 * stage + 2)
    real = {t.untyped_storage()._cdata for layer in built for t in layer.parameters() if not t.is_meta}
    assert real == {t.untyped_storage()._cdata for i in own for t in built[i].parameters()}  # the tie is one tensor
    for index in own:
        for (name, x), (_, y) in zip(built[index].state_dict().items(), whole[index].state_dict().items(), strict=True):
            assert torch.equal(x, y), (index, name)
