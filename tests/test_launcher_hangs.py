"""The launcher's hang rule (``rlstream.launcher.hung_roles``): a role is hung when its MetricEvents
stopped while other roles' went on arriving, never while it (re)starts and never while every role
is silent (the brokers away: a restart under load took 80 s, docs/results/reliability.md). The chaos runs
exercise it with real processes; these pin each branch of the rule."""

from rlstream.launcher import hung_roles

HANG = 90.0
T0 = 1_000_000.0  # wall time the processes started


def ev(t: float) -> dict:
    return {"timestamp_ms": int(t * 1000)}


WORKER_OF = {"reward-0": "reward-0", "rollout-0": "rollout-0", "t": "trainer"}
STARTED = {"reward-0": T0, "rollout-0": T0, "trainer": T0}


def test_a_role_silent_while_the_others_go_on_is_hung():
    now = T0 + 300
    workers = {"reward/reward-0": ev(T0 + 100), "rollout/rollout-0": ev(now - 1), "trainer/t": ev(now - 2)}
    assert hung_roles(workers, WORKER_OF, STARTED, now, HANG) == [("reward-0", 200.0)]


def test_silence_shorter_than_the_bound_is_not_a_hang():
    now = T0 + 300
    workers = {"reward/reward-0": ev(now - HANG + 5), "rollout/rollout-0": ev(now - 1)}
    assert hung_roles(workers, WORKER_OF, STARTED, now, HANG) == []


def test_nobody_is_hung_while_every_role_is_silent():
    """The brokers are away: the newest event of all is old too, so no role's silence counts."""
    now = T0 + 400
    workers = {"reward/reward-0": ev(T0 + 100), "rollout/rollout-0": ev(T0 + 150), "trainer/t": ev(T0 + 160)}
    assert hung_roles(workers, WORKER_OF, STARTED, now, HANG) == []
    # ... until the others come back: then the one still silent is hung, measured from the others' newest
    workers["rollout/rollout-0"], workers["trainer/t"] = ev(now - 1), ev(now - 2)
    assert hung_roles(workers, WORKER_OF, STARTED, now, HANG) == [("reward-0", 300.0)]


def test_a_restarting_role_is_not_judged_by_its_predecessor_s_events():
    """The newest event came from the process before the restart: setup may be long, so wait."""
    now = T0 + 300
    started = {**STARTED, "reward-0": now - 200}
    workers = {"reward/reward-0": ev(now - 250), "rollout/rollout-0": ev(now - 1)}
    assert hung_roles(workers, WORKER_OF, started, now, HANG) == []


def test_dead_and_unknown_roles_are_left_to_the_supervisor():
    now = T0 + 300
    workers = {"reward/reward-0": ev(T0 + 10), "rollout/rollout-0": ev(now - 1), "reward/stranger": ev(T0 + 10)}
    alive = {"rollout-0": T0}  # reward-0 has exited: its restart is the supervisor's business
    assert hung_roles(workers, WORKER_OF, alive, now, HANG) == []
