"""Whether a cluster can hold a pipeline's D x P x T stage actors, checked before any starts.

A cluster with an autoscaler grows on demand (placement then waits for nodes), so only a
fixed cluster can be refused up front; the caller says which it is.
"""

from __future__ import annotations

from collections.abc import Mapping


def check_capacity(
    *, dp: int, stages: int, tp: int, bundle: Mapping[str, float], cluster: Mapping[str, float], autoscaler: bool
) -> None:
    """ValueError naming the demand (D x P x T actors of `bundle`) when a fixed `cluster` (its
    total resources, `ray.cluster_resources()`) holds too little of any resource."""
    if autoscaler:
        return
    actors = dp * stages * tp
    short = {name: actors * amount for name, amount in bundle.items() if actors * amount > cluster.get(name, 0.0)}
    if short:
        need = ", ".join(f"{amount:g} {name}" for name, amount in short.items())
        have = ", ".join(f"{cluster.get(name, 0.0):g} {name}" for name in short)
        shape = f"{bundle}".replace("'", "")
        raise ValueError(
            f"dp x stages x tp = {dp} x {stages} x {tp} = {actors} stage actors of {shape} need {need}; "
            f"the cluster has {have} and no autoscaler is configured"
        )
