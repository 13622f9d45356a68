"""kvgate_testing/sched_stints.py reads `perf sched timehist -w` output (an excerpt recorded on this
kind of machine: a client 5272 sending through a router 5281 to a simulated engine 5273) into the
router's stints on a request's path."""

from kvgate_testing.sched_stints import SwitchOut, Wake, hop_stints, parse_timehist

TIMEHIST = """\
           time    cpu  task name                       wait time  sch delay   run time
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------
     947.196240 [0001]  swapper      awakened: python[5273]
     947.203088 [0001]  python[5273]      awakened: python[5281]
     947.203141 [0000]  <idle>                              1.318      0.000      5.438
     947.203319 [0000]  python[5281]      awakened: python[5272]
     947.203396 [0000]  python[5281]                        5.438      0.053      0.254
     947.204202 [0000]  python[5272]      awakened: python[5281]
     947.204212 [0000]  python[5272]                        6.112      0.076      0.815
     947.204323 [0000]  python[5281]                        0.815      0.009      0.111
     947.204366 [0000]  python[5272]      awakened: python[5281]
     947.204373 [0000]  python[5272]                        0.111      0.000      0.049
     947.204500 [0000]  python[5281]      awakened: python[5273]
     947.204554 [0000]  python[5281]                        0.049      0.006      0.181
     947.204616 [0000]  memfd:sealed-91[1296]              50.077      0.015      0.032
"""


def test_parse_timehist_reads_wake_ups_and_switches_and_skips_the_header():
    events = parse_timehist(TIMEHIST)
    assert events[0] == Wake(947.196240e6, None, 5273)  # the idle task wakes the engine
    assert events[1] == Wake(947.203088e6, 5273, 5281)
    assert isinstance(events[2], SwitchOut) and events[2].task is None
    assert events[4] == SwitchOut(947.203396e6, 5281, 254.0)
    assert events[-1].task == 1296  # a name with a colon and a dash
    assert len(events) == 13


def test_parse_timehist_reads_a_thread_as_its_own_id():
    """A thread that is not its process's main one is TASK[TID/PID]: the client's thread here."""
    lines = """\
     951.000100 [0000]  python[5300/5272]      awakened: python[5281]
     951.000200 [0000]  python[5281]      awakened: python[5300/5272]
     951.000300 [0000]  python[5300/5272]                        0.500      0.010      0.040
"""
    assert parse_timehist(lines) == [
        Wake(951.000100e6, 5300, 5281),
        Wake(951.000200e6, 5281, 5300),
        SwitchOut(951.000300e6, 5300, 40.0),
    ]


def test_hop_stints_times_each_side_of_the_router():
    stints = hop_stints(parse_timehist(TIMEHIST), client=5272, router=5281, engine=5273)
    assert [round(value) for value in stints.response_side_us] == [231]  # answer in -> written
    assert [round(value) for value in stints.after_write_us] == [77]  # written -> router away
    assert [round(value) for value in stints.router_run_us] == [254]
    # The request's head wakes the router (which runs before the client sends the body), then the
    # body does; from the head to the request sent on:
    assert [round(value) for value in stints.request_side_us] == [298]


def test_a_request_sent_to_an_awake_engine_has_no_request_side():
    """The engine was running when the router sent the request on (no wake-up of it): that request
    side is unknown, and the next request's is timed from its own head."""
    lines = """\
     952.000000 [0000]  python[5272]      awakened: python[5281]
     952.005000 [0001]  python[5273]      awakened: python[5281]
     952.005100 [0000]  python[5281]      awakened: python[5272]
     952.005150 [0000]  python[5281]                        0.100      0.010      0.150
     952.010000 [0000]  python[5272]      awakened: python[5281]
     952.010200 [0000]  python[5281]      awakened: python[5273]
"""
    stints = hop_stints(parse_timehist(lines), client=5272, router=5281, engine=5273)
    assert [round(value) for value in stints.request_side_us] == [200]


def test_hop_stints_ignore_other_tasks_and_a_direct_request():
    direct = """\
     950.000100 [0000]  python[5272]      awakened: python[5273]
     950.005000 [0001]  python[5273]      awakened: python[5272]
     950.005100 [0000]  python[5272]                        5.000      0.050      0.300
"""
    stints = hop_stints(parse_timehist(direct), client=5272, router=5281, engine=5273)
    assert stints.summary() == {
        "request_side_us": None,
        "response_side_us": None,
        "after_write_us": None,
        "router_run_us": None,
    }
