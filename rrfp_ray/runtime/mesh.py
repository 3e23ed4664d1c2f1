"""Where every actor of a DP x PP x TP pipeline sits: the one mapping between (replica, stage,
TP rank) and the actor index, the names errors give them, and which actors form each group.

Actors are numbered replica-major, then stage, then TP rank: index
`(replica * stages + stage) * tp + rank`. Both fabrics (threads in-process, stage actors on
Ray), the stage group and the fault plans read positions and groups from here only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from rrfp_ray.schedule.layout import Link


class Coord(NamedTuple):
    replica: int
    stage: int
    rank: int  # TP rank within the stage


@dataclass(frozen=True)
class Mesh:
    """`dp` replicas of `stages` stages of `tp` TP ranks; `ties`: each a set of stages (ascending)
    that hold copies of one tied parameter, summing its gradients over a group per TP rank and replica."""

    stages: int
    tp: int = 1
    dp: int = 1
    ties: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("stages", "tp", "dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for owners in self.ties:
            if len(owners) < 2 or list(owners) != sorted(set(owners)) or not 0 <= owners[0] <= owners[-1] < self.stages:
                raise ValueError(f"a tie needs >= 2 distinct ascending stages in [0, {self.stages}), got {owners}")

    @property
    def size(self) -> int:
        """Actors in all: dp x stages x tp."""
        return self.dp * self.stages * self.tp

    @property
    def per_replica(self) -> int:
        return self.stages * self.tp

    def index(self, *, stage: int, rank: int = 0, replica: int = 0) -> int:
        if not (0 <= replica < self.dp and 0 <= stage < self.stages and 0 <= rank < self.tp):
            raise ValueError(f"replica {replica}, stage {stage}, TP rank {rank}: outside the mesh {self}")
        return (replica * self.stages + stage) * self.tp + rank

    def coord(self, index: int) -> Coord:
        if not 0 <= index < self.size:
            raise ValueError(f"actor index must be in [0, {self.size}), got {index}")
        group, rank = divmod(index, self.tp)
        replica, stage = divmod(group, self.stages)
        return Coord(replica=replica, stage=stage, rank=rank)

    def replica_indices(self, replica: int) -> range:
        """The actors of one replica, in index order."""
        return range(replica * self.per_replica, (replica + 1) * self.per_replica)

    def label(self, index: int) -> str:
        """How errors and logs name one actor: "stage 1", "stage 1 TP rank 0", "replica 1 stage 1"."""
        replica, stage, rank = self.coord(index)
        return self.name(stage=stage, rank=rank, replica=replica)

    def name(self, *, stage: int, rank: int | None = None, replica: int | None = None) -> str:
        """A stage, or one TP rank of it (`rank`), in one replica or (`replica` None) in each."""
        replica_text = f"replica {replica} " if replica is not None and self.dp > 1 else ""
        return f"{replica_text}stage {stage}" + (f" TP rank {rank}" if rank is not None and self.tp > 1 else "")

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Each stage's TP ranks, per (replica, stage) in that order: group `tp_group(i)` holds actor i."""
        return [tuple(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.dp * self.stages)]

    def tp_group(self, index: int) -> int:
        return index // self.tp

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Each (stage, TP rank)'s actors across the replicas, in replica order: group `dp_group(i)` holds actor i."""
        return [
            tuple(self.index(replica=d, stage=s, rank=t) for d in range(self.dp))
            for s in range(self.stages)
            for t in range(self.tp)
        ]

    def dp_group(self, index: int) -> int:
        coord = self.coord(index)
        return coord.stage * self.tp + coord.rank

    def tie_groups(self) -> dict[tuple[tuple[int, ...], int, int], tuple[int, ...]]:
        """(owning stages, TP rank, replica) -> its actors, in stage order."""
        return {
            (owners, t, d): tuple(self.index(replica=d, stage=s, rank=t) for s in owners)
            for owners in self.ties
            for t in range(self.tp)
            for d in range(self.dp)
        }

    def link_ends(self, links: Iterable[Link]) -> dict[tuple[Link, int, int], tuple[int, int]]:
        """(link, TP rank, replica) -> (sender, receiver): rank t of a stage talks to rank t of its neighbours."""
        return {
            (link, t, d): (self.index(replica=d, stage=link.src, rank=t), self.index(replica=d, stage=link.dst, rank=t))
            for link in links
            for t in range(self.tp)
            for d in range(self.dp)
        }
