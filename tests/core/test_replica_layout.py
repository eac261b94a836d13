"""`ReplicaLayout`: groups of consecutive ranks, peers by position, and each worker's rows of a global batch."""

from __future__ import annotations

import pytest

from raytrain_events.core.replica_layout import ReplicaLayout, part_rows, quorum_part


def test_groups_positions_and_peers_at_a_real_shape():
    layout = ReplicaLayout(workers=12, group_size=4)  # 3 groups x 4 FSDP ranks
    assert layout.groups == 3
    assert [layout.group_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4
    assert [layout.position_of(r) for r in range(12)] == [0, 1, 2, 3] * 3
    assert layout.ranks_of(1) == [4, 5, 6, 7]
    assert layout.peers_of(6) == [2, 6, 10]  # position 2 of every group: one torchft process group
    with pytest.raises(ValueError, match="world rank 12"):
        layout.group_of(12)
    with pytest.raises(ValueError, match="replica group 3"):
        layout.ranks_of(3)


@pytest.mark.parametrize("participants", [1, 2, 3])
def test_every_row_of_a_global_batch_is_trained_once_at_any_quorum(participants):
    layout = ReplicaLayout(workers=12, group_size=4)
    for rows in (12 * 5, 12 * 5 + 7, 97):
        cut = [
            layout.rows(rows, participant, participants, position)
            for participant in range(participants)
            for position in range(4)
        ]
        covered = [i for a, b in cut for i in range(a, b)]
        assert covered == list(range(rows))  # contiguous, in order, each row once
        sizes = [b - a for a, b in cut]
        assert max(sizes) - min(sizes) <= 1


def test_a_group_of_one_cuts_as_the_one_worker_groups_do():
    layout = ReplicaLayout(workers=4)
    assert [layout.rows(12, p, 4, 0) for p in range(4)] == [part_rows(12, p, 4) for p in range(4)]
    assert layout.peers_of(3) == [0, 1, 2, 3]


def test_a_quorum_that_lost_a_group_gives_its_rows_to_the_others():
    layout = ReplicaLayout(workers=4, group_size=2)
    assert [layout.rows(12, 0, 2, pos) for pos in range(2)] + [layout.rows(12, 1, 2, pos) for pos in range(2)] == [
        (0, 3),
        (3, 6),
        (6, 9),
        (9, 12),
    ]
    assert [layout.rows(12, 0, 1, pos) for pos in range(2)] == [(0, 6), (6, 12)]  # one group away


@pytest.mark.parametrize(
    ("workers", "size", "match"),
    [
        (6, 4, r"does not divide num_workers=6.*num_workers a multiple of 4 \(e.g. 8\)"),
        (10, 4, r"does not divide num_workers=10.*\(e.g. 8 or 12\)"),
        (4, 4, r"makes 1 replica group.*num_workers=8 or more, or replica_group_size=2"),
        (4, 0, "must be a whole number of workers >= 1"),
        (4, True, "must be a whole number"),
    ],
)
def test_a_layout_that_cannot_be_made_is_refused_naming_the_fix(workers, size, match):
    with pytest.raises(ValueError, match=match):
        ReplicaLayout(workers=workers, group_size=size)


def test_a_global_batch_smaller_than_the_workers_is_refused():
    with pytest.raises(ValueError, match="cannot give each of 4 data-parallel parts a row"):
        ReplicaLayout(workers=4, group_size=2).rows(3, 0, 2, 0)


def test_an_eval_set_is_cut_by_position_so_every_group_evaluates_all_of_it():
    layout = ReplicaLayout(workers=12, group_size=4)  # 3 groups x 4 FSDP ranks
    parts = [layout.eval_part(r) for r in range(12)]
    assert parts == [0, 1, 2, 3] * 3  # each group's 4 workers: the set's 4 parts, once each
    for group in range(3):
        assert sorted(parts[r] for r in layout.ranks_of(group)) == list(range(4))
    assert [ReplicaLayout(workers=4).eval_part(r) for r in range(4)] == [0] * 4  # one-worker groups: the whole set
    with pytest.raises(ValueError, match="world rank 12"):
        layout.eval_part(12)


def test_tensor_groups_inside_a_replica_group_train_the_same_rows():
    """Groups of 4 = 2 FSDP x 2 TP (the tensor dimension innermost: positions 0-1 and 2-3 are tensor groups), 3 groups:
    a tensor group's ranks train the same part, every row once per data-parallel part at any quorum."""
    layout = ReplicaLayout(workers=12, group_size=4, tensor_parallel=2)
    assert layout.data_parts == 2
    assert [layout.eval_part(r) for r in range(12)] == [0, 0, 1, 1] * 3
    for participants in (1, 2, 3):
        for rows in (60, 67):
            cut = [[layout.rows(rows, g, participants, p) for p in range(4)] for g in range(participants)]
            for parts in cut:
                assert parts[0] == parts[1] and parts[2] == parts[3]  # each tensor group: one part
            once = [i for parts in cut for a, b in parts[::2] for i in range(a, b)]
            assert once == list(range(rows))
    assert quorum_part(2, 3, 3, group_size=4, tensor_parallel=2) == (5, 6)
    assert quorum_part(1, 2, 0) == (1, 2)  # one-worker groups: a part per group


def test_a_group_that_is_not_whole_tensor_groups_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"replica_group_size=6 is not a whole number of tensor groups.*e\.g\. 8"):
        ReplicaLayout(workers=12, group_size=6, tensor_parallel=4)
