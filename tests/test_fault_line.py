"""A fault a worker says (``WorkerMetrics.set_fault``) reaches the live view when it begins and
when it ends, and the run's fault log (report.json ``faults``)."""

from pipeline.metrics import WorkerMetrics
from rlstream.progress import Progress


def test_fault_said_once_when_it_begins_and_when_it_ends():
    m = WorkerMetrics("trainer", "t0")
    text = "disk full at /w (need 5 MB free, 1 MB left); paused"
    events = [m.set_fault(text)]
    assert m.set_fault(text) is None  # unchanged: no new event
    assert m.fault == text and events[0]["metrics"]["fault"] == 1.0 and events[0]["labels"]["fault"] == text
    events.append(m.publish())  # periodic events carry it while it lasts
    events.append(m.set_fault(None))
    assert m.fault is None and "fault" not in events[-1]["labels"] and events[-1]["metrics"]["fault"] == 0.0
    assert events[1]["labels"]["fault"] == text

    p = Progress()
    for i, ev in enumerate(events):
        p.add({**ev, "timestamp_ms": 1000 * (10 + 5 * i)})
    assert [line for _, line in p.to_say] == [text, f"resumed after 10 s (was: {text})"]
    assert p.fault_log == [{"worker": "trainer/t0", "text": text, "start": 10.0, "end": 20.0}]
    assert not p.faults
