"""Export a GPT checkpoint as the unsplit model's state dict (every stage, chunk and TP shard
gathered, tied weights once):

    python jobs/export.py --checkpoint-dir runs/train_gpt/checkpoints --out gpt.pt

The checkpoint directory holds `model.json` (the run's model and split, which
jobs/train_gpt.py writes beside its checkpoints); the newest complete checkpoint is exported. Load the file with
`torch.load(FILE, weights_only=True)` into `nn.Sequential(*GPT(config).layers())`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rrfp_ray.job import run_job


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint-dir", required=True, help="a checkpoint directory of jobs/train_gpt.py")
    parser.add_argument("--out", required=True, help="where the state dict goes (torch.save)")
    args = parser.parse_args(argv)
    from rrfp_ray.recipes.gpt_workload import MODEL_FILE, SavedModel
    from rrfp_ray.train.api import model_fingerprint
    from rrfp_ray.train.checkpoint import latest, load_stage
    from rrfp_ray.train.export import unsplit_state_dict

    directory = Path(args.checkpoint_dir)
    if not (directory / MODEL_FILE).is_file():
        parser.error(f"--checkpoint-dir {directory}: no {MODEL_FILE} (the run's model and split) in it")
    saved = SavedModel.read(directory)
    split = {"stages": saved.stages, "chunks": saved.chunks, "tp": saved.tp}
    manifest = latest(directory=directory, fingerprint=model_fingerprint(layers=saved.layers(), **split))
    if manifest is None:
        parser.error(f"--checkpoint-dir {directory}: no complete checkpoint of this run's model and split")
    shards = [load_stage(directory=directory, file=manifest.files[i])["chunks"] for i in sorted(manifest.files)]
    state = unsplit_state_dict(layers=saved.layers(), shards=shards, **split)
    out = Path(args.out)
    torch.save(state, out)
    print(f"wrote {out}: {len(state)} tensors from iteration {manifest.iteration} of {directory}")
    return out


if __name__ == "__main__":
    run_job(main)
