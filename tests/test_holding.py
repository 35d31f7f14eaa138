"""``producers.holding.SampleHold``: a message's finished samples come out together when its last
one finishes; samples taken back to run again are waited for like unfinished ones."""

from __future__ import annotations

from types import SimpleNamespace

from producers.holding import SampleHold


def sample(offset: int, index: int, stale: bool = False):
    return SimpleNamespace(tp=("p", 0), offset=offset, gen=0, index=index, stale=stale)


def test_a_message_is_published_whole_when_its_last_sample_finishes():
    hold = SampleHold()
    hold.admit((("p", 0), 7, 0), 3)
    a, b, c = (sample(7, i) for i in range(3))
    assert hold.finished(a) == [] and hold.finished(b) == [] and hold.held() == 2
    assert hold.finished(c) == [a, b, c] and hold.held() == 0
    other = sample(8, 0)  # never admitted here (e.g. admitted before the hold existed): at once
    assert hold.finished(other) == [other]


def test_samples_taken_back_are_waited_for():
    hold = SampleHold()
    hold.admit((("p", 0), 1, 0), 3)
    hold.admit((("p", 0), 2, 0), 2)
    a, b, c = sample(1, 0, stale=True), sample(1, 1), sample(1, 2)
    d, e = sample(2, 0, stale=True), sample(2, 1)
    assert hold.finished(a) == [] and hold.finished(b) == [] and hold.finished(d) == []
    again = hold.take(lambda s: s.stale)
    assert again == [a, d] and hold.held() == 1
    assert hold.finished(c) == []  # message 1 still waits for a, generated again
    assert hold.finished(a) == [b, c, a]
    assert hold.finished(e) == []  # message 2 waits for d
    assert hold.finished(d) == [e, d]
    assert hold.take(lambda s: True) == [] and hold.held() == 0
