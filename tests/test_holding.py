"""``producers.holding``: a message's finished samples come out together when its last one
finishes; samples taken back to run again are waited for like unfinished ones; ``StaleRestarts``
restarts exactly the samples the trainer is certain to drop, by the rule and scope configured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from producers.holding import GroupRace, SampleHold, StaleRestarts


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


def test_an_over_provisioned_message_passes_its_first_finishers_ranked_and_aborts_the_rest():
    race = GroupRace()
    drawn = [sample(5, i) for i in range(5)]
    for s in drawn:
        s.rank = None
    race.admit((("p", 0), 5, 0), drawn, 3)
    assert race.finished(drawn[3]) == ([], []) and race.finished(drawn[0]) == ([], []) and race.racing() == 2
    passed, losers = race.finished(drawn[4])
    assert passed == [drawn[3], drawn[0], drawn[4]] and [s.rank for s in passed] == [0, 1, 2]
    assert losers == [drawn[1], drawn[2]] and race.racing() == 0
    assert race.finished(drawn[0]) == ([drawn[0]], [])  # a winner generated again passes through
    other = sample(6, 0)
    other.rank = None
    assert race.finished(other) == ([other], [])  # a message drawn without extras


def rc(scope="all", restarts=1, policy="interrupt", margin=None):
    return SimpleNamespace(restart_scope=scope, stale_restarts=restarts, reload_policy=policy, restart_margin=margin)


def gen(version_min, version_max, restarts=0, env=None):
    return SimpleNamespace(version_min=version_min, version_max=version_max, restarts=restarts, env=env)


@pytest.mark.parametrize(
    "scope,in_flight,finished", [("all", True, True), ("in_flight", True, False), ("finished", False, True)]
)
def test_the_scope_picks_what_restarts(scope, in_flight, finished):
    p = StaleRestarts.of(rc(scope), "sample", k=2)
    assert (p.in_flight, p.finished) == (in_flight, finished)
    late = gen(0, 2)  # started under v0: stale for the sample rule once v3 is loaded (3 - 0 > 2)
    assert p.doomed(late, 3) is in_flight and p.doomed(late, 3, finished=True) is finished
    assert not p.doomed(late, 2) and not p.doomed(late, 2, finished=True)  # still inside the bound


def test_limits_rules_and_environments():
    sample_rule, token_rule = StaleRestarts.of(rc(), "sample", 1), StaleRestarts.of(rc(), "token", 1)
    assert not token_rule.in_flight  # the token rule trains a late sample's fresh tokens
    s = gen(0, 2)
    assert sample_rule.doomed(s, 2, finished=True)  # by its oldest token
    assert not token_rule.doomed(s, 3, finished=True) and token_rule.doomed(s, 4, finished=True)  # by its newest
    assert not sample_rule.doomed(gen(0, 2, restarts=1), 5, finished=True)  # restarts used up
    assert not sample_rule.doomed(gen(0, 2, env="math"), 5, finished=True)  # multi-turn: never
    assert not sample_rule.doomed(gen(None, None), 5, finished=True)  # nothing generated yet
    off = StaleRestarts.of(rc(restarts=0), "sample", 1)
    assert not off.finished and not off.doomed(s, 5)  # stale_restarts=0: no restarts at all
    assert not StaleRestarts.of(rc(policy="drain"), "sample", 1).in_flight


def test_the_release_margin_defaults_by_k_and_stale_ignores_the_limits():
    assert [StaleRestarts.of(rc(), "token", k).margin for k in (0, 1, 2, 4)] == [0, 0, 1, 1]
    assert StaleRestarts.of(rc(margin=3), "token", 1).margin == 3  # an explicit margin wins
    p = StaleRestarts.of(rc(), "token", 2)
    used = gen(0, 1, restarts=1)
    assert p.stale(used, 4, finished=True) and not p.doomed(used, 4, finished=True)  # stale, not restartable
    assert not p.stale(used, 3, finished=True)  # its newest token is inside the bound


def test_likely_lost_and_reopen_send_a_complete_messages_stale_samples_round_again():
    p = StaleRestarts.of(rc(), "token", 2)  # margin 1: checked at the loaded version + 1
    last, fresh, old = gen(3, 5), gen(4, 4), gen(0, 2)
    assert p.likely_lost(last, [fresh, old, last], loaded=5) == [old]  # 5 + 1 - 2 > 2
    assert p.likely_lost(gen(0, 2), [old, gen(0, 2)], loaded=5) == []  # the last one would not train either
    assert StaleRestarts.of(rc(), "token", 1).likely_lost(last, [old, last], loaded=5) == []  # margin 0 at k = 1
    hold = SampleHold()
    a, b, c = sample(7, 0), sample(7, 1), sample(7, 2)
    hold.admit(SampleHold.key(a), 3)
    assert hold.finished(a) == [] and hold.finished(b) == []
    done = hold.finished(c)
    hold.reopen(c, done, [a])
    assert hold.held() == 2 and hold.finished(a) == [b, c, a]  # the message waited for a alone


def test_a_load_regenerates_held_samples_with_the_margin_only_where_the_waited_for_sample_trains():
    held = gen(2, 2)  # finished under v2, its message still waiting for a long sample
    token = StaleRestarts.of(rc(), "token", 2)  # token rule + interrupt: the long sample takes fresh tokens
    assert token.load_margin == 1
    assert not token.held_doomed(held, 3) and token.held_doomed(held, 4)  # dropped at 4 + 1 (5 - 2 > 2)
    assert not token.doomed(held, 4, finished=True)  # without the margin it would wait for the drop
    sample = StaleRestarts.of(rc(), "sample", 2)  # the long sample itself will be stale: no look-ahead
    drain = StaleRestarts.of(rc(policy="drain"), "token", 2)  # it keeps its old tokens to the end
    for p in (sample, drain):
        assert p.margin == 1 and p.load_margin == 0 and not p.held_doomed(held, 4) and p.held_doomed(held, 5)
    assert StaleRestarts.of(rc(), "token", 1).load_margin == 0  # margin 0 at k = 1
