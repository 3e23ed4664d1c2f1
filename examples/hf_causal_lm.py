"""A Hugging Face causal LM (GPT-2 family, small config, random init: nothing is downloaded),
split by its blocks and trained on the Python stdlib's sources through the public Trainer.

    pip install 'rrfp-ray[hf]'            # transformers
    python examples/hf_causal_lm.py       # every stage a thread of this process
    python examples/hf_causal_lm.py --ray # every stage a Ray actor (starts a local Ray)
    python examples/hf_causal_lm.py --save out/gpt2   # then GPT2LMHeadModel.from_pretrained("out/gpt2")

The layer list wraps the model's own modules: an embedding stage, one stage part per
transformer block, and the head. The boundaries carry what the blocks need: a dict of the
hidden states, the attention mask (causal and padding, built once from the token ids) and
the position ids. The LM head shares the token embedding's weight (GPT-2 ties them); the
pipeline finds the tie and keeps the two stages' copies identical. Batches are whole
paragraphs of varying length (`--varlen` data), so the loss is token-weighted.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

from rrfp_ray import Optim, PipelineConfig, Trainer
from rrfp_ray.models.gpt import lm_loss_sum
from rrfp_ray.train.data import PAD, CorpusSource
from rrfp_ray.train.export import load_unsplit

SEQ_LEN = 32


def config() -> GPT2Config:
    return GPT2Config(
        vocab_size=256,  # bytes
        n_positions=SEQ_LEN,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
        bos_token_id=None,
        eos_token_id=None,
    )


class Embed(nn.Module):
    """Token ids -> {hidden, mask, positions}: what every block needs."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.wte, self.wpe = model.transformer.wte, model.transformer.wpe

    def forward(self, ids: Tensor) -> dict[str, Tensor]:
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device).expand_as(ids)
        causal = torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
        mask = causal[None, None] & (ids != PAD)[:, None, None, :]  # (B, 1, T, T): True where a query may look
        return {"hidden": self.wte(ids) + self.wpe(positions), "mask": mask, "positions": positions}


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: dict[str, Tensor]) -> dict[str, Tensor]:
        hidden = self.block(x["hidden"], attention_mask=x["mask"], position_ids=x["positions"])
        return {**x, "hidden": hidden[0] if isinstance(hidden, tuple) else hidden}


class Head(nn.Module):
    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.ln_f, self.lm_head = model.transformer.ln_f, model.lm_head

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        return self.lm_head(self.ln_f(x["hidden"]))


def layers_of(model: GPT2LMHeadModel) -> list[nn.Module]:
    """The pipeline's layer list over `model`'s own modules (sharing its tensors)."""
    return [Embed(model), *(Block(block) for block in model.transformer.h), Head(model)]


def build() -> list[nn.Module]:
    """The Trainer runs this under its seeded RNG: every stage builds the same random weights."""
    return layers_of(GPT2LMHeadModel(config()))


def data(*, microbatches: int, split: str = "train") -> CorpusSource:
    return CorpusSource(
        path=None, micro_batch_size=4, seq_len=SEQ_LEN, microbatches=microbatches, seed=0, split=split, varlen=True
    )


def trainer(*, stages: int = 3, policy: str = "bfw", backend=None, microbatches: int = 4) -> Trainer:
    return Trainer(
        model=build,
        loss_fn=lm_loss_sum,
        data=data(microbatches=microbatches),
        val_data=data(microbatches=2, split="val"),
        pipeline=PipelineConfig(stages=stages, microbatches=microbatches, policy=policy, timeout_s=60),
        optimizer=Optim(lr=3e-3, warmup=2, total=20),
        backend=backend,
    )


def unsplit(state: dict[str, Tensor]) -> GPT2LMHeadModel:
    """A GPT2LMHeadModel holding the pipeline's exported weights (`Trainer.state_dict()`)."""
    model = GPT2LMHeadModel(config())
    load_unsplit(nn.Sequential(*layers_of(model)), state)
    return model


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ray", action="store_true", help="run the stages as Ray actors")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--save", default=None, help="save_pretrained the trained model here")
    args = parser.parse_args(argv)
    backend = None
    if args.ray:
        from actors.backend import RayBackend

        backend = RayBackend()
    losses = []
    with trainer(backend=backend) as run:
        print(f"tied between stages: {[tie.names for tie in run.workload.ties]}")
        for _ in range(args.iterations):
            report = run.step()
            losses.append(report.loss)
            print(f"iter {report.iteration:3d}  loss {report.loss:.4f}  {report.makespan_ms:6.1f} ms")
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; validation loss {run.evaluate():.4f}")
        state = run.state_dict()
    if args.save:
        unsplit(state).save_pretrained(Path(args.save))
        print(f"saved to {args.save} (GPT2LMHeadModel.from_pretrained loads it)")
    return losses


if __name__ == "__main__":
    main()
