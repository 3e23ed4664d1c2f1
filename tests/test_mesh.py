"""The mesh: one mapping between (replica, stage, TP rank) and the actor index, its labels and groups."""

from __future__ import annotations

import pytest

from rrfp_ray.runtime.mesh import Coord, Mesh
from rrfp_ray.schedule.layout import Layout

MESHES = [Mesh(stages=1), Mesh(stages=3), Mesh(stages=2, tp=2), Mesh(stages=3, dp=2), Mesh(stages=4, tp=2, dp=3)]


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_index_and_coord_are_inverse(mesh: Mesh):
    coords = [mesh.coord(i) for i in range(mesh.size)]
    assert len(set(coords)) == mesh.size == mesh.dp * mesh.stages * mesh.tp
    assert all(mesh.index(replica=d, stage=s, rank=t) == i for i, (d, s, t) in enumerate(coords))
    assert coords[0] == Coord(replica=0, stage=0, rank=0)
    assert coords[-1] == Coord(replica=mesh.dp - 1, stage=mesh.stages - 1, rank=mesh.tp - 1)


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_each_kind_of_group_partitions_the_actors(mesh: Mesh):
    for groups, position in ((mesh.tp_groups(), mesh.tp_group), (mesh.dp_groups(), mesh.dp_group)):
        assert sorted(i for group in groups for i in group) == list(range(mesh.size))
        assert all(i in groups[position(i)] for i in range(mesh.size))
    for members in mesh.tp_groups():  # one stage of one replica, by TP rank
        assert {mesh.coord(i)[:2] for i in members} == {mesh.coord(members[0])[:2]}
        assert [mesh.coord(i).rank for i in members] == list(range(mesh.tp))
    for members in mesh.dp_groups():  # one (stage, TP rank), by replica
        assert {mesh.coord(i)[1:] for i in members} == {mesh.coord(members[0])[1:]}
        assert [mesh.coord(i).replica for i in members] == list(range(mesh.dp))
    replicas = [list(mesh.replica_indices(d)) for d in range(mesh.dp)]
    assert sum(replicas, []) == list(range(mesh.size))


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_labels_are_unique_and_name_only_what_varies(mesh: Mesh):
    labels = [mesh.label(i) for i in range(mesh.size)]
    assert len(set(labels)) == mesh.size
    assert all(("TP rank" in label) == (mesh.tp > 1) for label in labels)
    assert all(("replica" in label) == (mesh.dp > 1) for label in labels)


def test_labels_read_as_before():
    mesh = Mesh(stages=2, tp=2, dp=2)
    assert mesh.label(mesh.index(replica=1, stage=1, rank=0)) == "replica 1 stage 1 TP rank 0"
    assert Mesh(stages=3).label(2) == "stage 2"
    assert mesh.name(stage=1, rank=1) == "stage 1 TP rank 1"  # every replica's


def test_links_join_the_same_rank_of_neighbours_in_one_replica():
    mesh = Mesh(stages=3, tp=2, dp=2)
    layout = Layout(stages=3, chunks=2, microbatches=3, split=False)
    ends = mesh.link_ends(layout.links())
    assert len(ends) == len(layout.links()) * mesh.tp * mesh.dp
    for (link, t, d), (sender, receiver) in ends.items():
        assert mesh.coord(sender) == Coord(replica=d, stage=link.src, rank=t)
        assert mesh.coord(receiver) == Coord(replica=d, stage=link.dst, rank=t)


def test_tie_groups_hold_the_owning_stages_per_rank_and_replica():
    mesh = Mesh(stages=4, tp=2, dp=2, ties=((0, 3),))
    groups = mesh.tie_groups()
    assert len(groups) == mesh.tp * mesh.dp
    for (owners, t, d), members in groups.items():
        assert [mesh.coord(i) for i in members] == [Coord(replica=d, stage=s, rank=t) for s in owners]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"stages": 0}, "stages"), ({"stages": 2, "tp": 0}, "tp"), ({"stages": 2, "ties": ((1, 0),)}, "tie")],
)
def test_bad_meshes_name_what_is_wrong(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Mesh(**kwargs)


def test_positions_outside_the_mesh_are_refused():
    mesh = Mesh(stages=2, tp=2)
    with pytest.raises(ValueError, match="outside"):
        mesh.index(stage=2)
    with pytest.raises(ValueError, match="index"):
        mesh.coord(4)
