"""Training over the pipeline: stage runners, workloads, optimizers, checkpoints, data, config and the Trainer API."""
