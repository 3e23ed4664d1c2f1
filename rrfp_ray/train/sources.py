"""What a workload reads its microbatches from (`DataSource` and what a source may also show), and
whether a workload can train on microbatches packed anew (`check_packing`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor

from rrfp_ray.plan.packing import Packing

if TYPE_CHECKING:
    from rrfp_ray.train.workload import ModelWorkload


class DataSource(Protocol):
    microbatches: int  # how many microbatches an iteration has (validation: how many `evaluate` runs)

    def microbatch(self, *, iteration: int, index: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of microbatch `index` of `iteration`; the same in every process."""
        ...


@runtime_checkable
class FeatureSource(Protocol):
    """A data source that also says what each microbatch shows before it runs, for planning (`planned`)."""

    def features(self, *, iteration: int) -> list[float]:
        """Per microbatch of `iteration`, a cost feature (real tokens, images), without building a batch."""
        ...


@runtime_checkable
class SampleSource(Protocol):
    """A data source that shows and serves the samples of an iteration's global batch, so an iteration can
    train on microbatches packed anew (`rrfp_ray.plan.packing`). The samples are numbered microbatch by
    microbatch: the data's own microbatch m holds samples m x B .. (m + 1) x B - 1 (B samples each)."""

    def sample_features(self, *, iteration: int) -> list[float]:
        """Per sample of `iteration`'s global batch, a cost feature (their sums per microbatch are `features`)."""
        ...

    def samples(self, *, iteration: int, indexes: Sequence[int]) -> tuple[Any, Tensor]:
        """(inputs, targets) of one microbatch made of the samples `indexes` of `iteration`, padded as the
        source pads its own microbatches; the same in every process."""
        ...


def packing_refusal(workload: ModelWorkload) -> str | None:
    """Why `workload` cannot train on packed microbatches (None: it can)."""
    if not workload.counted_loss:
        return (
            "packing regroups samples between microbatches, which changes a per-microbatch mean loss: it needs "
            "a loss_fn that returns (sum, count), as lm_loss_sum and caption_loss do (a token-weighted loss)"
        )
    if not isinstance(workload.data, SampleSource):
        return (
            f"packing needs a data source with sample_features(iteration=) and samples(iteration=, indexes=) "
            f"(SampleSource); {type(workload.data).__name__} has not got them"
        )
    return None


def check_packing(*, packing: Packing, workload: ModelWorkload, iteration: int) -> None:
    """ValueError unless `workload` can train `iteration` on `packing`: D x M non-empty microbatches placing every
    sample of the global batch once, from a `SampleSource`, under a (sum, count) loss."""
    refusal = packing_refusal(workload)
    if refusal is not None:
        raise ValueError(refusal)
    data = workload.data
    groups = workload.microbatches * workload.dp
    count = len(data.sample_features(iteration=iteration))
    placed = sorted(i for group in packing for i in group)
    if len(packing) != groups or not all(packing) or placed != list(range(count)):
        raise ValueError(
            f"packing must place each of the {count} samples of iteration {iteration} once in "
            f"dp x microbatches = {groups} non-empty microbatches"
        )
