"""TcpGather: the TP agreement's all-gather over direct TCP connections (threads, one process)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rrfp_ray.runtime.tcp_gather import TcpGather


def _group(size: int, *, timeout_s: float = 10.0) -> list[TcpGather]:
    ranks = [TcpGather(rank=r, size=size, host="127.0.0.1", timeout_s=timeout_s) for r in range(size)]
    addresses = [g.address for g in ranks]
    with ThreadPoolExecutor(max_workers=size) as pool:  # highest rank first: dials precede accepts
        list(pool.map(lambda g: g.connect(addresses=addresses), reversed(ranks)))
    return ranks


def _gather_all(group: list[TcpGather], values: list[list[int]]) -> list[list[list[int]]]:
    with ThreadPoolExecutor(max_workers=len(group)) as pool:
        return list(pool.map(lambda gv: gv[0].all_gather(gv[1]), zip(group, values)))


def test_every_rank_gets_every_list_in_rank_order_round_after_round() -> None:
    group = _group(3)
    try:
        for round_ in range(20):
            values = [[round_, 10 * r, -1, 2**40 + r] for r in range(3)]
            assert _gather_all(group, values) == [values] * 3
    finally:
        for g in group:
            g.close()


def test_a_group_of_one_gathers_its_own_list() -> None:
    (only,) = _group(1)
    assert only.all_gather([7, -1]) == [[7, -1]]


def test_lists_of_different_lengths_are_refused() -> None:
    group = _group(2)
    with pytest.raises(ValueError, match="rank 1 gathered 3 values, this rank 2"):
        _gather_all(group, [[1, 2], [1, 2, 3]])


def test_a_silent_peer_times_out_naming_what_was_awaited() -> None:
    group = _group(2, timeout_s=0.2)
    with pytest.raises(TimeoutError, match="TP rank 0: waited 0.2 s for TP rank 1's list"):
        group[0].all_gather([1])


def test_a_closed_peer_fails_the_round_naming_it() -> None:
    group = _group(2)
    group[1].close()
    with pytest.raises(ConnectionError, match="TP rank 0: connection closed while waiting for TP rank 1's list"):
        group[0].all_gather([1])


def test_a_rank_that_never_connects_is_named() -> None:
    group = [TcpGather(rank=r, size=3, host="127.0.0.1", timeout_s=0.3) for r in range(3)]
    addresses = [g.address for g in group]
    with (
        pytest.raises(TimeoutError, match=r"TP rank 0: ranks \[2\] did not connect within 0.3 s"),
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        list(pool.map(lambda g: g.connect(addresses=addresses), group[:2]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": 2, "size": 2}, r"rank must be in \[0, 2\), got 2"),
        ({"rank": 0, "size": 0}, "size must be >= 1, got 0"),
        ({"rank": 0, "size": 2, "timeout_s": 0}, "timeout_s must be > 0, got 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TcpGather(host="127.0.0.1", **{"timeout_s": 1.0, **kwargs})


def test_gather_before_connect_and_a_wrong_address_count_are_named() -> None:
    rank = TcpGather(rank=0, size=2, host="127.0.0.1", timeout_s=1.0)
    with pytest.raises(RuntimeError, match="all_gather before connect"):
        rank.all_gather([1])
    with pytest.raises(ValueError, match="addresses must hold 2 entries"):
        rank.connect(addresses=[rank.address])
