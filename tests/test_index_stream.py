"""The KV-event stream's sequence rules (`router.index.stream`), without sockets: what a live batch,
a replay's answer, a snapshot and a connection mean, and the replay wait and backoff, each driven
by the seqs, publish times and clock readings the transport would hand over."""

from __future__ import annotations

import pytest

from kvwire import encode_seq
from router.errors import KvgateError
from router.index.stream import (
    EventStream,
    MalformedReply,
    ReplayBackoff,
    ReplayWait,
    Verdict,
    parse_replay_reply,
    replies_in_range,
)


def applied_through(stream: EventStream, last: int, ts: float = 100.0) -> EventStream:
    """`stream` after live batches 0..last, all published at `ts` or before."""
    for seq in range(last + 1):
        step = stream.on_live(seq, ts)
        assert step.verdict is Verdict.APPLY and step.replay_from is None and not step.restart
        stream.applied(seq, ts)
    return stream


def test_the_next_seq_is_applied_without_a_check() -> None:
    stream = applied_through(EventStream(replay=True), 4)
    assert stream.is_next(5) and not stream.is_next(6) and not stream.is_next(4)
    stream.take_next(5)
    assert stream.is_next(6) and stream.newest_seq == 5
    # Shown only once its events are in the index (a reader of the stats never runs ahead of it).
    assert stream.stats.last_seq == 4
    stream.released(ts=101.0)
    assert stream.stats.last_seq == 5
    step = stream.on_live(6, 101.0)
    assert (step.verdict, step.last_seq, step.replay_from, step.restart) == (Verdict.APPLY, 5, None, False)
    assert stream.stats.duplicates == stream.stats.restarts == stream.stats.replays == 0


def test_a_gap_asks_for_a_replay_of_the_missing_seqs_and_a_full_answer_fills_it() -> None:
    stream = applied_through(EventStream(replay=True), 2)
    step = stream.on_live(6, 101.0)
    assert (step.verdict, step.replay_from, step.late_start, step.restart) == (Verdict.APPLY, 3, False, False)
    assert stream.begin_gap_replay(now=0.0)
    stream.replayed([3, 4, 5], None, 100.5)
    assert stream.gap_outcome(3, 6, [3, 4, 5], None, late_start=False) is None
    stream.applied(6, 101.0)
    stats = stream.stats
    assert (stats.last_seq, stats.replays, stats.replayed_batches, stats.unrecovered_gaps) == (6, 1, 3, 0)
    assert not stats.uncertain


def test_a_gap_the_replay_cannot_fill_is_counted_and_makes_the_backend_uncertain() -> None:
    stream = applied_through(EventStream(replay=True), 2)
    assert stream.on_live(6, 101.0).replay_from == 3
    reason = stream.gap_outcome(3, 6, [4], None, late_start=False)
    assert reason == "lost seq 3..5; replay recovered 1 of 3"
    assert stream.stats.unrecovered_gaps == 1
    assert stream.stats.uncertain and stream.stats.uncertain_reason == reason


def test_seqs_missing_before_a_replayed_clear_do_not_make_the_gap_unrecovered() -> None:
    stream = applied_through(EventStream(replay=True), 2)
    # The engine's buffer lost 3 and 4, but batch 5 holds AllBlocksCleared: nothing before it survived.
    assert stream.gap_outcome(3, 7, [5, 6], 5, late_start=False) is None
    assert not stream.stats.uncertain and stream.stats.unrecovered_gaps == 0
    # Without the clear the same answer leaves a gap.
    assert stream.gap_outcome(3, 7, [5, 6], None, late_start=False) is not None


def test_the_first_batch_past_seq_0_replays_the_history_from_0_as_a_late_start() -> None:
    stream = EventStream(replay=True)
    step = stream.on_live(5, 100.0)
    assert (step.verdict, step.last_seq, step.replay_from, step.late_start) == (Verdict.APPLY, None, 0, True)
    assert not stream.stats.synced  # not before the replay is in
    # The engine no longer buffers seq 0..1: uncertain, but a late start is not a lost gap.
    reason = stream.gap_outcome(0, 5, [2, 3, 4], None, late_start=True)
    assert reason == "subscribed late (first seq 5); the engine no longer buffers seq 0.."
    assert stream.stats.uncertain and stream.stats.unrecovered_gaps == 0
    stream.applied(5, 100.0)
    assert stream.stats.synced and stream.stats.last_seq == 5


def test_a_first_batch_at_seq_0_needs_no_replay() -> None:
    stream = EventStream(replay=True)
    step = stream.on_live(0, 100.0)
    assert step.verdict is Verdict.APPLY and step.replay_from is None and not step.restart
    stream.applied(0, 100.0)
    assert stream.stats.synced and stream.stats.last_seq == 0


def test_a_stepped_back_seq_published_later_is_a_restart() -> None:
    stream = applied_through(EventStream(replay=True), 5, ts=100.0)
    step = stream.on_live(0, 200.0)
    assert (step.verdict, step.restart, step.last_seq, step.replay_from) == (Verdict.APPLY, True, 5, None)
    assert stream.stats.duplicates == 0
    stream.mark_uncertain("lost seq 1..2")
    stream.cleared()  # the transport cleared the backend
    assert not stream.stats.uncertain and stream.stats.uncertain_reason is None
    stream.applied(0, 200.0)
    assert stream.is_next(1)
    # Counted once handled, so a reader of `restarts` finds the new engine's batch in the index.
    assert stream.stats.restarts == 0
    stream.restarted()
    assert stream.stats.restarts == 1


def test_a_restart_seen_past_seq_0_replays_the_new_engine_from_0() -> None:
    stream = applied_through(EventStream(replay=True), 5, ts=100.0)
    step = stream.on_live(2, 200.0)
    assert (step.restart, step.replay_from, step.late_start) == (True, 0, True)


@pytest.mark.parametrize("ts", [100.0, 50.0])
def test_a_stepped_back_seq_published_no_later_is_a_duplicate_ignored_and_counted(ts: float) -> None:
    stream = applied_through(EventStream(replay=True), 5, ts=100.0)
    for seq in (5, 5, 1):
        step = stream.on_live(seq, ts)
        assert (step.verdict, step.last_seq, step.restart) == (Verdict.DUPLICATE, 5, False)
    assert stream.stats.duplicates == 3 and stream.stats.restarts == 0
    assert stream.stats.last_seq == 5 and stream.is_next(6)


def test_an_undecodable_stepped_back_batch_is_a_restart_only_at_seq_0() -> None:
    stream = applied_through(EventStream(replay=True), 5)
    assert stream.on_live(3, None).verdict is Verdict.DUPLICATE
    step = stream.on_live(0, None)
    assert step.verdict is Verdict.APPLY and step.restart
    stream.applied(0, None)  # its seq advances all the same
    assert stream.stats.last_seq == 0 and stream.is_next(1)


def test_the_catch_up_replay_syncs_and_drops_live_batches_it_already_holds() -> None:
    stream = EventStream(replay=True)
    assert stream.on_connected(now=0.0) is False  # no snapshots from this publisher
    assert stream.needs_catch_up()
    stream.replayed([0, 1, 2], None, 100.0)
    assert stream.caught_up([0, 1, 2], None, 100.0, complete=True) is None
    stats = stream.stats
    assert stats.synced and stats.last_seq == 2 and stats.replays == 1 and not stream.needs_catch_up()
    # Live batches queued before the answer: held already (not duplicates), and no fast path yet.
    assert not stream.is_next(3)
    assert stream.on_live(1, 99.0).verdict is Verdict.ALREADY_HELD
    assert stream.on_live(2, 100.0).verdict is Verdict.ALREADY_HELD
    assert stats.duplicates == 0
    # The first batch past the answer clears the mark: in order again.
    assert stream.on_live(3, 101.0).replay_from is None
    stream.applied(3, 101.0)
    assert stream.is_next(4)


def test_a_batch_under_the_catch_up_mark_published_later_is_a_restart() -> None:
    stream = EventStream(replay=True)
    stream.replayed([0, 1, 2], None, 100.0)
    stream.caught_up([0, 1, 2], None, 100.0, complete=True)
    assert stream.on_live(0, 150.0).restart


def test_a_catch_up_missing_seq_0_leaves_the_backend_uncertain() -> None:
    stream = EventStream(replay=True)
    reason = stream.caught_up([3, 4], None, 100.0, complete=True)
    assert reason == "subscribed late (engine at seq 4); the engine no longer buffers seq 0.."
    assert stream.stats.uncertain and stream.stats.synced
    # Unless a clear in the answer makes what came before it dead.
    stream = EventStream(replay=True)
    assert stream.caught_up([3, 4], 3, 100.0, complete=True) is None


def test_a_catch_up_without_an_answer_waits_for_the_first_batch() -> None:
    stream = EventStream(replay=True)
    assert stream.caught_up([], None, 0.0, complete=False) is None
    assert not stream.stats.synced and stream.needs_catch_up()
    assert stream.stats.replays == 0
    # An empty but complete answer (nothing buffered yet) is a catch-up.
    stream = EventStream(replay=True)
    stream.caught_up([], None, 0.0, complete=True)
    assert stream.stats.synced and stream.stats.last_seq is None


def test_a_snapshot_replaces_the_backend_and_sets_where_the_live_stream_resumes() -> None:
    stream = applied_through(EventStream(replay=True, snapshot=True), 3)
    stream.mark_uncertain("lost seq 4..6")
    stream.snapshot_applied(next_seq=10, ts=150.0, blocks=7)
    stats = stream.stats
    assert (stats.snapshots, stats.snapshot_blocks, stats.last_seq, stats.synced) == (1, 7, 9, True)
    assert not stats.uncertain and stats.last_snapshot_error is None
    # Older batches published before it are held by it; a later one under next_seq is a restart.
    assert stream.on_live(8, 140.0).verdict is Verdict.ALREADY_HELD
    assert stream.on_live(8, 160.0).restart


def test_the_batch_that_led_to_a_snapshot_is_dropped_when_the_snapshot_holds_it() -> None:
    stream = applied_through(EventStream(replay=True, snapshot=True), 3)
    stream.snapshot_applied(next_seq=10, ts=150.0, blocks=0)
    assert stream.after_snapshot(9).verdict is Verdict.ALREADY_HELD
    step = stream.after_snapshot(10)
    assert step.verdict is Verdict.APPLY and step.replay_from is None and stream.live_floor is None
    # A batch past it leaves a gap to replay.
    stream.snapshot_applied(next_seq=10, ts=150.0, blocks=0)
    assert stream.after_snapshot(13).replay_from == 10


def test_a_snapshot_of_an_engine_that_published_nothing_leaves_no_last_seq() -> None:
    stream = EventStream(replay=True, snapshot=True)
    stream.snapshot_applied(next_seq=0, ts=10.0, blocks=0)
    assert stream.stats.last_seq is None and stream.stats.synced
    assert stream.after_snapshot(0).verdict is Verdict.APPLY


def test_a_failed_snapshot_is_counted_with_its_reason() -> None:
    stream = EventStream(replay=True, snapshot=True)
    stream.snapshot_failed("no complete answer within 1.0s")
    assert stream.stats.snapshot_failures == 1
    assert stream.stats.last_snapshot_error == "no complete answer within 1.0s"
    assert stream.stats.snapshots == 0 and not stream.stats.synced


def test_a_snapshot_is_asked_for_on_the_first_connection_and_after_a_long_enough_outage() -> None:
    stream = EventStream(replay=True, snapshot=True, snapshot_after_outage_s=5.0)
    assert stream.on_connected(now=0.0) is True  # the state is unknown
    assert stream.on_connected(now=1.0) is False  # already connected: nothing changed
    stream.snapshot_applied(next_seq=3, ts=1.0, blocks=0)
    stream.on_disconnected(now=10.0)
    assert not stream.stats.connected
    assert stream.on_connected(now=12.0) is False  # a 2 s outage: shorter than 5 s
    stream.on_disconnected(now=20.0)
    stream.on_disconnected(now=24.0)  # (a second event while down does not move the outage's start)
    assert stream.on_connected(now=25.0) is True


@pytest.mark.parametrize(("replay", "snapshot"), [(True, False), (False, True)])
def test_no_snapshot_without_snapshot_support_and_a_replay_endpoint(replay: bool, snapshot: bool) -> None:
    stream = EventStream(replay=replay, snapshot=snapshot)
    assert stream.on_connected(now=0.0) is False


def test_without_a_replay_endpoint_a_gap_is_unrecovered_at_once() -> None:
    stream = applied_through(EventStream(replay=False), 2)
    assert not stream.may_replay(now=0.0) and not stream.begin_gap_replay(now=0.0)
    assert stream.stats.replays == stream.stats.skipped_replays == 0
    assert stream.gap_outcome(3, 5, [], None, late_start=False) is not None
    assert stream.stats.unrecovered_gaps == 1


def test_replay_replies_in_either_format_and_the_end_marker() -> None:
    seq, payload = encode_seq(7), b"\x93payload"
    assert parse_replay_reply([b"", seq, payload], 1 << 20) == (7, payload)  # vLLM < 0.26
    assert parse_replay_reply([b"", b"kv-events", seq, payload], 1 << 20) == (7, payload)
    assert parse_replay_reply([b"kv-events", seq, payload], 1 << 20) == (7, payload)  # delimiter gone
    assert parse_replay_reply([b"", encode_seq(-1), b""], 1 << 20) is None
    assert parse_replay_reply([b"", b"kv-events", encode_seq(-1), b""], 1 << 20) is None


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", b"x", b"y", b"z", b"w"], "replay reply with 4 frames"),
        ([b"", encode_seq(1)], "replay reply with 1 frames"),
        ([b"", b"\x01\x02", b"payload"], "replay:"),
        ([b"", encode_seq(2), b"x" * 101], "replay seq 2: 101 bytes, over max_message_bytes"),
    ],
)
def test_a_malformed_or_oversized_replay_reply_is_refused_with_its_reason(
    frames: list[bytes], message: str
) -> None:
    with pytest.raises(MalformedReply, match=message) as raised:
        parse_replay_reply(frames, 100)
    assert isinstance(raised.value, KvgateError) and isinstance(raised.value, ValueError)


def test_replies_in_range_keep_the_first_copy_of_each_seq_in_order() -> None:
    replies = [(5, b"e"), (3, b"c"), (3, b"c-again"), (9, b"live"), (1, b"old"), (4, b"d")]
    assert replies_in_range(replies, 3, 9) == {3: b"c", 4: b"d", 5: b"e"}
    assert list(replies_in_range(replies, 3, 9)) == [3, 4, 5]
    assert replies_in_range(replies, 0, None) == {1: b"old", 3: b"c", 4: b"d", 5: b"e", 9: b"live"}


def test_a_replay_wait_is_extended_by_each_reply_up_to_ten_timeouts() -> None:
    wait = ReplayWait(started=100.0, timeout_s=1.0)
    assert wait.remaining(100.0) == pytest.approx(1.0)
    assert wait.remaining(101.0) <= 0  # nothing came: timed out
    wait = ReplayWait(started=100.0, timeout_s=1.0)
    wait.replied(100.9)
    assert wait.remaining(101.5) == pytest.approx(0.4)  # a reply restarts the timeout
    for now in (101.8, 102.7, 103.6, 104.5, 105.4, 106.3, 107.2, 108.1, 109.0, 109.9):
        wait.replied(now)
    assert wait.remaining(109.95) == pytest.approx(0.05)  # never past 10 timeouts after the request
    assert wait.remaining(110.0) <= 0


def test_a_silent_replay_endpoint_is_paused_after_two_unanswered_requests_doubling_to_30_s() -> None:
    backoff = ReplayBackoff(timeout_s=1.0)
    assert backoff.unanswered(now=0.0) is False and not backoff.paused(0.5)  # one lost answer: no pause
    assert backoff.unanswered(now=1.0) is True
    assert backoff.paused(1.5) and not backoff.paused(2.0)
    pauses = []
    for n in range(7):
        backoff.unanswered(now=10.0 * n)
        pauses.append(backoff.pause_s)
    assert pauses == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    backoff.answered()  # any answer resets it: one more lost answer is no pause
    assert backoff.pause_s == 0.0
    assert backoff.unanswered(now=100.0) is False and not backoff.paused(100.0)


def test_replays_skipped_for_the_backoff_are_counted_and_each_stream_backs_off_alone() -> None:
    silent, other = (
        EventStream(replay=True, replay_timeout_s=0.5),
        EventStream(replay=True, replay_timeout_s=0.5),
    )
    silent.backoff.unanswered(now=0.0)
    silent.backoff.unanswered(now=1.0)
    assert not silent.begin_gap_replay(now=1.2) and not silent.may_replay(now=1.3)
    assert (silent.stats.skipped_replays, silent.stats.replays) == (2, 0)
    assert other.begin_gap_replay(now=1.2) and other.stats.skipped_replays == 0  # another backend asks
    assert silent.begin_gap_replay(now=1.5) and silent.stats.replays == 1  # the pause is over


def test_a_failed_apply_marks_the_backend_uncertain_until_a_clear() -> None:
    stream = applied_through(EventStream(replay=True), 1)
    stream.mark_uncertain("seq 1: the index failed to apply the batch (see the log)")
    assert stream.stats.uncertain and "failed to apply" in (stream.stats.uncertain_reason or "")
    stream.cleared()
    assert not stream.stats.uncertain
