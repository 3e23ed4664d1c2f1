"""Export a GPT checkpoint as the unsplit model's state dict (every stage's weights, TP shards
put back together, tied weights once), whatever pipeline shape wrote it:

    python jobs/export.py --checkpoint-dir runs/train_gpt/checkpoints --out gpt.pt

The checkpoint directory holds `model.json` (the run's model, which
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
    from rrfp_ray.train.build import model_parameters
    from rrfp_ray.train.checkpoint import latest, parameters_fingerprint
    from rrfp_ray.train.export import checkpoint_state_dict

    directory = Path(args.checkpoint_dir)
    if not (directory / MODEL_FILE).is_file():
        parser.error(f"--checkpoint-dir {directory}: no {MODEL_FILE} (the run's model) in it")
    layers = SavedModel.read(directory).layers()
    parameters = model_parameters(layers())
    manifest = latest(directory=directory, fingerprint=parameters_fingerprint(parameters), parameters=parameters)
    if manifest is None:
        parser.error(f"--checkpoint-dir {directory}: no complete checkpoint of this run's model")
    state = checkpoint_state_dict(layers=layers, directory=directory, manifest=manifest)
    out = Path(args.out)
    torch.save(state, out)
    print(f"wrote {out}: {len(state)} tensors from iteration {manifest.iteration} of {directory}")
    return out


if __name__ == "__main__":
    run_job(main)
