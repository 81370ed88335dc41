"""The client's verdict on its loop is judged by the thresholds of the daemon's last answer to its
report (no copy of them in the client): "starting" until an answer comes, "unknown" where none
can (TCP, a daemon that takes no reports or reports no thresholds)."""

import types

import grpc
import pytest

from larder.inputstats import Meter, verdict
from larder.v1 import larder_pb2 as pb


def batch(stream_id=7, size=4):
    return types.SimpleNamespace(size=size, stream_id=stream_id)


def feed(meter, waits_and_steps):
    for wait, step in waits_and_steps:
        meter.record(wait, step, batch())


class Refused(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def test_the_verdict_follows_the_thresholds_the_daemon_answers_with():
    answers = [pb.StreamInfo(input_bound_above=0.5, compute_bound_below=0.1, cause="raw reads")]
    meter = Meter("job", "train", lambda request, timeout: answers[-1], advice=False)
    assert meter.stats().verdict == "starting", "no answer yet"
    # 30% of 2 s waiting: balanced by the daemon's 50%/10%, where 20%/5% would say input-bound.
    feed(meter, [(0.3, 0.7), (0.3, 0.7)])
    stats = meter.stats()
    assert (stats.wait_ratio, stats.verdict, stats.cause) == (pytest.approx(0.3), "balanced", "raw reads")
    answers.append(pb.StreamInfo(input_bound_above=0.25, compute_bound_below=0.05))
    meter.record(0.3, 0.7, batch(stream_id=8))  # a new stream: reported at its first batch
    assert meter.stats().verdict == "input-bound", "the last answer's thresholds"
    answers.append(pb.StreamInfo(input_bound_above=0.9, compute_bound_below=0.35))
    meter.record(0.3, 0.7, batch(stream_id=9))
    assert meter.stats().verdict == "compute-bound"


def test_under_a_second_measured_is_starting():
    meter = Meter("job", "train", lambda request, timeout: pb.StreamInfo(input_bound_above=0.2,
                                                                          compute_bound_below=0.05))
    feed(meter, [(0.1, 0.2)])
    assert meter.stats().verdict == "starting"
    feed(meter, [(0.5, 0.5)])
    assert meter.stats().verdict == "input-bound"


def test_unknown_where_no_answer_can_come():
    # Over TCP: no reports at all.
    tcp = Meter("job", "train", None)
    feed(tcp, [(0.5, 0.5), (0.5, 0.5)])
    assert tcp.stats().verdict == "unknown"
    # A daemon that reports no thresholds (they read 0.0).
    silent = Meter("job", "train", lambda request, timeout: pb.StreamInfo(cause="raw reads"))
    assert silent.stats().verdict == "starting"
    feed(silent, [(0.5, 0.5), (0.5, 0.5)])
    assert silent.stats().verdict == "unknown" and silent.stats().cause == "raw reads"

    # A daemon that takes no reports.
    def unimplemented(request, timeout):
        raise Refused(grpc.StatusCode.UNIMPLEMENTED)

    old = Meter("job", "train", unimplemented)
    feed(old, [(0.5, 0.5), (0.5, 0.5)])
    assert old.stats().verdict == "unknown"
    # A daemon that numbers no streams (stream_id 0): nothing to report on.
    unnumbered = Meter("job", "train", lambda request, timeout: pb.StreamInfo(input_bound_above=0.2))
    unnumbered.record(0.5, 0.5, batch(stream_id=0))
    unnumbered.record(0.5, 0.5, batch(stream_id=0))
    assert unnumbered.stats().verdict == "unknown"


def test_a_busy_daemon_leaves_the_verdict_at_its_last_answer():
    calls = []

    def report(request, timeout):
        calls.append(request)
        if len(calls) > 1:
            raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED)
        return pb.StreamInfo(input_bound_above=0.2, compute_bound_below=0.05)

    meter = Meter("job", "train", report)
    feed(meter, [(0.0, 0.0), (0.01, 0.99)])
    meter.record(0.01, 0.99, batch(stream_id=8))  # reported, refused: quiet for a while
    meter.record(0.01, 0.99, batch(stream_id=9))
    assert len(calls) == 2 and meter.stats().verdict == "compute-bound"


def test_the_verdict_function():
    answer = pb.StreamInfo(input_bound_above=0.2, compute_bound_below=0.05)
    assert verdict(5.0, 0.21, answer, True) == "input-bound"
    assert verdict(5.0, 0.2, answer, True) == "balanced"
    assert verdict(5.0, 0.05, answer, True) == "balanced"
    assert verdict(5.0, 0.04, answer, True) == "compute-bound"
    assert verdict(0.5, 0.9, answer, True) == "starting"
    assert verdict(5.0, 0.9, None, True) == "starting"
    assert verdict(5.0, 0.9, None, False) == "unknown"
    assert verdict(5.0, 0.9, pb.StreamInfo(), True) == "unknown"
