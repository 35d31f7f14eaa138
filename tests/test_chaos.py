"""The fault run (``rlstream chaos``).

* The audit on synthetic data: a clean run passes, and each kind of damage (a sample trained twice,
  a lost sample, a group never fed, a rollout scored twice, a bad record missing from the DLQ, a
  staleness violation, a non-finite step) makes it fail: the audit can fail.
* The supervisor's event log: a kill of ours is recorded as injected (restarted, not a crash), a
  real crash and a watchdog exit are not.
* The bad records: each kind is wrong in the way its name says.
* The shortened run itself (``slow``, ``kafka``): real roles, its own broker (restarted), kill -9 of
  the trainer and the feed, a join/leave, bad records, and one fault of each kind the installed
  fault classes plan (network, storage, process: ``rlstream.dev.chaos_faults``); it must PASS, its
  concurrent auditor must have seen every record (tests/test_chaos_live.py tests that auditor), and
  it must report the availability of every fault kind that happened.
"""

import copy
import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from pipeline import codec
from pipeline.errors import DecodeError
from rlstream.broker import LocalBroker
from rlstream.config import BrokerConfig
from rlstream.dev import chaos_audit as ca
from rlstream.dev import chaos_live as cl
from rlstream.dev.fuzz import KINDS, SCHEMA_OF, RecordBuilder
from rlstream.supervisor import RestartPolicy, Supervisor
from tests.conftest import rlstream_cmd

TOPICS = {"prompts": "x.prompts", "rollouts": "x.rollouts", "scored": "x.scored"}


def clean_run(groups: int = 4, size: int = 2, per_step: int = 2):
    """What the topics and the steps log hold after a perfect run, plus three injected bad records
    (one dead-lettered twice, one refused by the trainer after it was scored)."""
    prompts, rollouts, scored, steps = [], [], [], []
    for g in range(groups):
        prompts.append({"p": 0, "o": g, "group_seq": g, "group_id": f"g{g}", "group_size": size, "feed": "default"})
        for j in range(size):
            o = g * size + j
            rollouts.append({"p": 0, "o": o, "tid": f"g{g}/{j}", "gid": f"g{g}"})
            scored.append(
                {"p": 0, "o": o, "tid": f"g{g}/{j}", "gid": f"g{g}", "version_min": g // per_step, "src": (0, o)}
            )
    for s in range(groups // per_step):
        gids = [f"g{g}" for g in range(s * per_step, (s + 1) * per_step)]
        steps.append(
            {
                "step": s + 1,
                "version": s,
                "used": [f"{g}/{j}" for g in gids for j in range(size)],
                "stale": [],
                "incomplete_dropped": [],
                "groups": gids,
                "loss": 0.1,
                "grad_norm": 1.0,
                "staleness": {"0": per_step * size},
            }
        )
    fuzz = [
        {"topic": "rollouts", "kind": "random_bytes", "partition": 0, "offset": 100},
        {"topic": "scored", "kind": "reward_nan", "partition": 0, "offset": 101},
        {"topic": "rollouts", "kind": "logprob_nan", "partition": 0, "offset": 102},
    ]
    scored.append({"p": 0, "o": 101, "tid": "fuzz-1/0", "gid": "fuzz-1", "version_min": 0, "src": (-1, -1)})
    scored.append({"p": 0, "o": 102, "tid": "fuzz-2/0", "gid": "fuzz-2", "version_min": 0, "src": (0, 102)})
    letter = {"error_type": "invalid", "reason": "bad", "role": "trainer"}
    dlq = [
        {"p": 0, "o": 0, "source": ("x.rollouts", 0, 100), **letter, "error_type": "decode", "role": "reward"},
        {"p": 0, "o": 1, "source": ("x.rollouts", 0, 100), **letter, "error_type": "decode", "role": "reward"},
        {"p": 0, "o": 2, "source": ("x.scored", 0, 101), **letter},
        {"p": 0, "o": 3, "source": ("x.scored", 0, 102), **letter},  # matched through its scored copy
    ]
    data = {"prompts": prompts, "rollouts": rollouts, "scored": scored, "dlq": dlq}
    return data, steps, fuzz


def run_audit(data, steps, fuzz, groups: int = 4):
    return ca.audit(data, steps, fuzz, topics=TOPICS, feed="default", expected_groups=groups, k=1)


def judge(a: dict, sup: dict | None = None):
    sup = sup or ca.supervision([])
    planned = {"kills": 0, "broker_restarts": 0}
    return ca.verdict(a, sup, {"planned": planned, "done": planned}, "ok", 1.0)


def test_audit_of_a_clean_run_passes():
    a = run_audit(*clean_run())
    v = judge(a)
    assert v["verdict"] == "PASS", v
    assert a["fed_groups"] == 4 and a["steps"] == 2 and a["samples_used"] == 8
    assert a["fuzz_injected"] == 3 and a["dlq_missing"] == 0 and a["dlq_repeats"] == 1
    assert a["fuzz_by_kind"]["rollouts/logprob_nan"]["roles"] == {"trainer": 1}
    assert ca.verdict_line(v).startswith("chaos: PASS kills=0 ")


DAMAGE = {
    "trained_twice": lambda d, s, f: s[1]["used"].append("g0/0"),
    "lost": lambda d, s, f: s[1]["used"].remove("g3/1"),
    "lost (never fed)": lambda d, s, f: d["prompts"].pop(),
    "scored_twice": lambda d, s, f: d["scored"].append({**d["scored"][0], "o": 50}),
    "dlq_missing": lambda d, s, f: d["dlq"].pop(),
    # rl.scored partition 0 holds rollouts offset 2 before offset 1
    "out_of_order": lambda d, s, f: d["scored"][1].update(src=(0, 2)) or d["scored"][2].update(src=(0, 1)),
    "staleness_violations": lambda d, s, f: s[1].update(version=5),
    "nonfinite_steps": lambda d, s, f: s[0].update(loss=math.nan),
    "fresh samples dropped as stale": lambda d, s, f: s[1]["stale"].append(s[1]["used"].pop()),
    "stalled": lambda d, s, f: (s.pop(), d["prompts"].append({**d["prompts"][0], "group_seq": 9, "o": 9})),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_audit_fails_on_damaged_data(damage):
    data, steps, fuzz = copy.deepcopy(clean_run())
    DAMAGE[damage](data, steps, fuzz)
    v = judge(run_audit(data, steps, fuzz))
    assert v["verdict"] == "FAIL"
    assert any(damage.split(" (")[0] in reason for reason in v["failed"]), v
    assert "chaos: FAIL" in ca.verdict_line(v)


def test_a_bad_record_past_its_groups_committed_offset_is_unread_not_missing():
    """The job ends with the trainer's last step; a bad record written after its stage's last read
    has no dead letter yet, and no reader has skipped it: unread. One below the committed offset
    without a dead letter is missing."""
    data, steps, fuzz = clean_run()
    data["dlq"] = [d for d in data["dlq"] if d["source"] != ("x.rollouts", 0, 100)]  # no letter for o=100

    def audit_with(committed_rollouts: int) -> dict:
        upto = {("x.rollouts", 0): committed_rollouts, ("x.scored", 0): 200}
        return ca.audit(data, steps, fuzz, topics=TOPICS, feed="default", expected_groups=4, k=1, read_upto=upto)

    unread = audit_with(100)  # the reward group stopped at offset 100: the bad record there was never read
    assert unread["dlq_missing"] == 0 and unread["fuzz_unread"] == 1
    assert unread["fuzz_by_kind"]["rollouts/random_bytes"]["unread"] == 1
    v = judge(unread)
    assert v["verdict"] == "PASS" and "fuzz_unread_at_end=1 " in ca.verdict_line(v)
    read = audit_with(101)  # committed past it: it was read, and its dead letter is missing
    assert read["dlq_missing"] == 1 and read["fuzz_unread"] == 0 and judge(read)["verdict"] == "FAIL"
    assert run_audit(data, steps, fuzz)["dlq_missing"] == 1  # without the positions: every record counts


def test_faults_that_did_not_happen_fail_the_run():
    a = run_audit(*clean_run())
    v = ca.verdict(a, ca.supervision([]), {"planned": {"kills": 3}, "done": {"kills": 1}}, "ok", 1.0)
    assert v["verdict"] == "FAIL" and "planned kills not done (1/3)" in v["failed"]


def wait_until(pred, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_supervisor_records_our_kills_apart_from_crashes_and_hangs(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]

    def once(code: int) -> list[str]:  # exits with ``code`` the first time, then sleeps like the others
        flag = tmp_path / f"ran-{code}"
        src = f"import pathlib, sys, time; f = pathlib.Path({str(flag)!r})\nif not f.exists(): f.touch(); sys.exit({code})\ntime.sleep(120)"
        return [sys.executable, "-c", src]

    sup = Supervisor(tmp_path / "logs", restart=RestartPolicy(backoff_s=0.1))
    try:
        first = sup.start("victim", sleeper).proc.pid
        assert sup.inject("victim", signal.SIGKILL, "test kill -9") == first
        assert sup.inject("victim", signal.SIGKILL, "again") is None  # one signal of ours at a time
        assert wait_until(lambda: (sup.check(), sup.alive("victim") and sup.children["victim"].proc.pid != first)[1])
        sup.start("crasher", once(3))
        sup.start("hung", once(75))
        assert wait_until(
            lambda: (sup.check(), sup.alive("crasher") and sup.alive("hung") and sup.restarts_total == 3)[1]
        )
        sup.start("joiner", sleeper)
        sup.retire("joiner", timeout=30, cause="leave")
        assert wait_until(lambda: (sup.check(), not sup.retiring)[1])
    finally:
        sup.stop_all(timeout=10)
    events = [json.loads(line) for line in (tmp_path / "logs" / "events.jsonl").read_text().splitlines()]
    assert events == sup.events
    s = ca.supervision(events)
    assert s["kills"] == {"victim": 1} and s["restarts"] == 3
    assert [c["name"] for c in s["crashes"]] == ["crasher"]
    assert [h["name"] for h in s["hangs"]] == ["hung"]
    # a plain sleeper has no SIGTERM handler: it dies of the signal (-15), an unclean stop, not a crash
    assert {u["name"] for u in s["unclean_stops"]} == {"joiner", "victim", "crasher", "hung"}
    stopped = [e for e in events if e["event"] == "stopped" and e["name"] == "joiner"]
    assert stopped and stopped[0]["code"] == -signal.SIGTERM and stopped[0]["cause"] == "leave"
    assert sup.children == {} and not sup.retiring


def test_stuck_in_reads_the_worker_thread_of_a_watchdog_dump():
    tail = (
        'Current thread 0x1 (most recent call first):\n  File "/r/pipeline/worker.py", line 137 in _die\n\n'
        'Thread 0x2 (most recent call first):\n  File "/r/pipeline/kafka.py", line 544 in commit\n'
        '  File "/r/producers/rollout.py", line 384 in _commit\n  File "/r/pipeline/worker.py", line 203 in run\n'
    )
    assert ca.stuck_in(tail) == [
        "pipeline/kafka.py:544 commit",
        "producers/rollout.py:384 _commit",
        "pipeline/worker.py:203 run",
    ]


def wrong_as_named(kind: str, rec: dict) -> bool:
    t = rec.get("trajectory", rec)
    checks = {
        "token_out_of_vocab": lambda: max(codec.unpack_i32(t["response_tokens"])) >= 19,
        "token_negative": lambda: min(codec.unpack_i32(t["response_tokens"])) < 0,
        "logprob_nan": lambda: any(math.isnan(x) for x in codec.unpack_f32(t["logprobs"])),
        "logprob_inf": lambda: any(math.isinf(x) for x in codec.unpack_f32(t["logprobs"])),
        "reward_nan": lambda: math.isnan(rec["reward"]),
        "reward_inf": lambda: math.isinf(rec["reward"]),
        "version_inverted": lambda: t["version_max"] < t["version_min"],
        "empty_tokens": lambda: t["response_tokens"] == b"",
        "group_seq_negative": lambda: t["group_seq"] < -1,
        "group_size_zero": lambda: t["group_size"] == 0,
        "huge_text": lambda: len(t.get("text", t.get("response_text", ""))) > 2_000_000,
        "empty_text": lambda: t["text"] == "",
        "max_new_tokens_nonpositive": lambda: t["max_new_tokens"] <= 0,
    }
    return checks[kind]()


@pytest.mark.parametrize("topic", sorted(KINDS))
def test_every_bad_record_is_wrong_as_named(topic):
    b = RecordBuilder("next_digit", 19, random.Random(0))
    assert codec.decode_as(codec.encode(SCHEMA_OF[topic], b.valid(topic, 0)), SCHEMA_OF[topic])
    for kind in KINDS[topic]:
        value, _ = b.value(topic, kind, 1)
        if kind in ("random_bytes", "truncated", "wrong_schema"):
            with pytest.raises(DecodeError):
                codec.decode(value, SCHEMA_OF[topic])
        else:
            assert wrong_as_named(kind, codec.decode_as(value, SCHEMA_OF[topic])), (topic, kind)


@pytest.mark.kafka
@pytest.mark.slow
def test_availability_figures_from_steps_and_kills():
    """ETTR, trainer kill -> next step and the trainer's longest idle after a rollout kill, on a
    hand-made timeline: steps of 1 s ending every 2 s from t=102 to t=200, except a 30 s hole after
    a trainer kill at t=150.5; a rollout kill at t=120.5 with no hole."""
    ends = [t for t in range(102, 201, 2) if not 150 < t < 180]
    steps = [{"step": i, "time": t, "step_time_s": 1.0} for i, t in enumerate(ends)]
    kill = lambda name, t: {"event": "signal", "signal": "SIGKILL", "name": name, "time": t}  # noqa: E731
    events = [kill("trainer", 150.5), kill("rollout-1", 120.5), {"event": "restart", "name": "trainer", "time": 152}]
    a = ca.availability(steps, events, 100.0, 200.0)
    assert a["ettr"] == round(len(ends) / 100, 3)
    assert a["trainer_kill_to_step_s"] == [29.5]  # the first step end after 150.5 is 180
    assert a["rollout_kill_trainer_idle_s"] == [30.0]  # its window (to 240.5) holds the 150 -> 180 hole
    assert a["kills_per_min"] == 1.2
    assert ca.availability_line(a).startswith("availability: ettr=0.")
    assert ca.availability([], events, 100.0, None)["ettr"] is None
    # the harness held groups back from 160 to 170 (the trainer ran dry): not counted against a fault
    held = ca.availability(steps, events, 100.0, 200.0, hold=(160.0, 170.0))
    assert held["trainer_kill_to_step_s"] == [19.5] and held["rollout_kill_trainer_idle_s"] == [20.0]
    assert held["ettr"] == round(len(ends) / 90, 3)


def test_tiny_fault_run_passes(tmp_path):
    """The CI fault run: its own broker (port 0, data in its run dir, so it never touches the test
    session's broker), kill -9 of the trainer and the feed, a broker restart, a join/leave and ~50
    bad records; every wait inside is event-based with generous deadlines."""
    out = tmp_path / "chaos"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLSTREAM_")}
    env.update(RLSTREAM_HOME=str(tmp_path / "home"), RLSTREAM_RUN_DIR=str(tmp_path / "runs"), PYTHONUNBUFFERED="1")
    if "RLSTREAM_CACHE" in os.environ:
        env["RLSTREAM_CACHE"] = os.environ["RLSTREAM_CACHE"]
    try:
        with open(tmp_path / "chaos.err", "w") as err:
            proc = subprocess.run(
                [*rlstream_cmd(), "chaos", "--size", "tiny", "--out", str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=2400,
            )
    finally:  # if the run was killed, its broker (a separate session, by design) must not outlive the test
        LocalBroker(BrokerConfig(port=0, data_dir=out / "broker")).stop(progress=lambda m: None)
    lines = proc.stdout.strip().splitlines()
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    why = (
        json.dumps({k: report.get(k) for k in ("line", "failed", "status")}, indent=1)
        + "\n"
        + json.dumps(
            [
                {k: h.get(k) for k in ("name", "kind", "stuck_in", "code")}
                for h in report.get("supervision", {}).get("hangs", [])
                + report.get("supervision", {}).get("crashes", [])
            ],
            indent=1,
        )
    )
    if not report:
        why += (tmp_path / "chaos.err").read_text()[-3000:]
    assert proc.returncode == 0, why
    assert lines and lines[-1].startswith("chaos: PASS "), why
    done, audit = report["faults"]["done"], report["audit"]
    assert done["trainer_kills"] >= 1 and done["feed_kills"] >= 1 and done["kills"] >= 4, done
    assert done["broker_restarts"] >= 1 and done["joins"] >= 1, done
    assert audit["fuzz_injected"] >= 40 and audit["dlq_missing"] == 0
    assert audit["fed_groups"] == report["plan"]["groups"] and audit["steps"] == report["plan"]["max_steps"]
    assert (out / "logs" / "trainer.log").is_file() and (out / "logs" / "events.jsonl").is_file()
    avail = report["availability"]  # printed above the verdict line; figures, not targets
    assert lines[-2].startswith("availability: ettr=") and 0 < avail["ettr"] <= 1, (lines[-2:], avail)
    assert len(avail["trainer_kill_to_step_s"]) == done["trainer_kills"], avail
    base = {"kills", "trainer_kills", "feed_kills", "broker_restarts", "joins", "fuzz", "worker_kills"}
    classes = {k: n for k, n in report["faults"]["planned"].items() if k not in base}
    assert all(done[k] == n for k, n in classes.items()), (classes, done)  # the fault classes' faults happened
    rows = {r["kind"]: r for r in report["by_fault_class"]}
    assert {"kill", "broker", *classes} <= set(rows), rows
    assert all(rows[k]["n"] >= 1 for k in classes) and rows["kill"]["n"] == done["kills"], rows
    err = (tmp_path / "chaos.err").read_text()
    assert all(f"[chaos] {k}: n=" in err for k in rows), err[-3000:]
    live = report["live_audit"]  # the concurrent read_committed auditor saw everything, in order
    assert live["counts"] == dict.fromkeys(cl.COUNTERS, 0) and live["seen"] == live["final"], live
    assert live["seen"]["scored"] >= report["plan"]["groups"] and " live_seen=" in lines[-1], live


@pytest.mark.parametrize("size", ["tiny", "full"])
def test_a_cluster_plan_kills_every_node_pauses_one_and_rolls(size):
    """--nodes 3: every node SIGKILLed at least once (one of them down for minutes at full size), a
    pause and a rolling restart, at most one broker fault per segment of the chaos phase."""
    import random

    from rlstream.dev.chaos import ChaosOptions, plan_faults

    p = ChaosOptions(size=size, nodes=3).plan(8)
    broker = [f for f in plan_faults(p, random.Random(0), p["duration_s"]) if f.kind == "broker"]
    targets = [f.target for f in broker]
    assert {t for t in targets if t.startswith("kill:")} == {"kill:1", "kill:2", "kill:3"}
    assert sum(t.startswith("pause:") for t in targets) == 1 and targets.count("rolling") == 1
    assert max(f.arg for f in broker if f.target.startswith("kill:")) == p["long_down_s"]
    assert len(broker) == p["broker_restarts"]
    assert ChaosOptions(size=size).plan(8)["broker_restarts"] == {"tiny": 1, "full": 2}[size]  # one broker: as before
    assert ChaosOptions(size=size, nodes=3, broker_restarts=2).plan(8)["broker_restarts"] == 5  # raised to every node
    # an explicit 0: a cluster under role kills only (availability runs); no broker fault planned
    quiet = ChaosOptions(size=size, nodes=3, broker_restarts=0).plan(8)
    assert quiet["broker_restarts"] == 0
    assert not [f for f in plan_faults(quiet, random.Random(0), quiet["duration_s"]) if f.kind == "broker"]
