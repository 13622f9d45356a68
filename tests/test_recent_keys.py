"""RecentKeys: membership of the latest keys, bounded by two generations."""

from __future__ import annotations

from router.recent_keys import RecentKeys


def test_a_key_is_seen_while_fewer_than_half_the_bound_came_after_it_and_gone_after_the_bound() -> None:
    recent = RecentKeys(max_keys=4)
    assert not recent.seen_before("first")
    assert recent.seen_before("first")  # seen: not added twice
    assert not recent.seen_before("b")  # 2 of 4: the newer generation is full and becomes the older
    assert recent.seen_before("first")  # still there, in the older one
    assert not recent.seen_before("c")
    assert not recent.seen_before("d")  # the next generation is full: the first one is dropped
    assert not recent.seen_before("first")


def test_batches_are_added_whole_and_read_by_membership() -> None:
    recent = RecentKeys(max_keys=8)
    recent.add([1, 2, 3])
    assert 1 in recent and 3 in recent and 4 not in recent
    recent.add([4, 5])  # 5 keys: past half the bound, they all move to the older generation
    assert 1 in recent and 5 in recent
    recent.add([6, 7, 8, 9])  # a full newer generation again: the batch of 1-5 is gone
    assert 1 not in recent and 5 not in recent and 9 in recent
