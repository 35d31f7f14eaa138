"""The fault classes of ``rlstream chaos`` (``rlstream.dev.chaos_faults``) and the availability per
fault class (``chaos_audit.by_fault_class``, ``chaos_docs.by_fault_class``), without a broker:

* the registry leaves out a class whose module is not installed (said once) and fails loudly on a
  module that is there but cannot import; the classes plan from a size's counts, take the kinds
  they declare, and every class is closed (once) even when another's ``close`` raises;
* every size has the per-class counts, and the options override them and name them in the command;
* the availability per fault class on a hand-made timeline, and its table in the docs block.

The classes themselves run against real processes and filesystems in their own tests; the whole
run (every class installed, real roles, a real broker) is ``tests/test_chaos.py``'s tiny fault run.
"""

from __future__ import annotations

import sys
import types

import pytest

from rlstream.dev import chaos_audit as ca
from rlstream.dev import chaos_docs, chaos_faults
from rlstream.dev.chaos_faults import COUNT_KEYS, ChaosContext, FaultClasses
from rlstream.dev.chaos_plan import SIZES, ChaosOptions, Fault


class PauseFaults:
    """A fault class for these tests: ``pause`` faults that last ``arg`` seconds of the harness's time."""

    kinds = ("pause",)

    def __init__(self, ctx):
        self.ctx, self.done, self.active = ctx, [], []

    def plan(self, p, rng, duration_s):
        return [
            Fault(rng.uniform(0.1, 0.5) * duration_s, "pause", "rollout-0", arg=5.0) for _ in range(p.get("stops", 0))
        ]

    def do(self, f, t):
        self.active.append((f, t))
        return f"pause {f.target}"

    def poll(self, t):
        for f, t0 in list(self.active):
            if t >= t0 + f.arg:
                self.active.remove((f, t0))
                self.done.append({"kind": f.kind, "target": f.target, "t": t0, "seconds": t - t0, "seen": []})

    @property
    def busy(self):
        return bool(self.active)

    def close(self):
        self.poll(float("inf"))
        self.ctx.say("closed")


class BrokenClose(PauseFaults):
    kinds = ("broken",)

    def plan(self, p, rng, duration_s):
        return []

    def close(self):
        raise RuntimeError("cannot heal")


@pytest.fixture
def registry(monkeypatch):
    mod = types.ModuleType("chaos_test_classes")
    mod.PauseFaults, mod.BrokenClose = PauseFaults, BrokenClose
    monkeypatch.setitem(sys.modules, "chaos_test_classes", mod)
    monkeypatch.setattr(
        chaos_faults,
        "FAULT_CLASSES",
        {
            "pause": ("chaos_test_classes", "PauseFaults", ("stops",)),
            "broken": ("chaos_test_classes", "BrokenClose", ()),
            "absent": ("chaos_test_classes_not_installed", "X", ("partitions",)),
        },
    )


def ctx(said: list[str]) -> ChaosContext:
    return ChaosContext(cfg=None, launcher=None, run_dir=".", broker_ops=None, say=said.append, rng=None)


def test_registry_plans_dispatches_and_closes_every_class(registry):
    said: list[str] = []
    classes = FaultClasses(ctx(said), {"stops": 2, "partitions": 1}, 100.0, seed=0)
    assert [type(c).__name__ for c in classes.classes] == ["PauseFaults", "BrokenClose"]
    assert said == ["absent faults planned but chaos_test_classes_not_installed is not installed: none run"]
    assert [f.kind for f in classes.faults] == ["pause", "pause"] and all(10 <= f.at <= 50 for f in classes.faults)
    f = classes.faults[0]
    owner = classes.owner(f)
    assert owner is classes.classes[0] and classes.owner(Fault(0, "kill")) is None
    launcher = object()
    classes.set_launcher(launcher)
    assert owner.ctx.launcher is launcher
    assert owner.do(f, 20.0) == "pause rollout-0" and classes.busy and classes.busy_kinds() == ["pause"]
    classes.poll(22.0)
    assert classes.busy  # 5 s, not over yet
    classes.poll(25.0)
    assert not classes.busy and classes.done() == [
        {"kind": "pause", "target": "rollout-0", "t": 20.0, "seconds": 5.0, "seen": []}
    ]
    owner.do(classes.faults[1], 30.0)
    with pytest.raises(RuntimeError, match="cannot heal"):  # the broken one raises, after the others closed
        classes.close()
    assert not classes.busy and said[-1] == "closed" and len(classes.done()) == 2
    classes.close()  # once
    assert said.count("closed") == 1


def test_a_module_that_exists_but_cannot_import_fails_loudly(monkeypatch, tmp_path):
    (tmp_path / "chaos_test_broken_import.py").write_text("import chaos_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(chaos_faults, "FAULT_CLASSES", {"x": ("chaos_test_broken_import", "X", ())})
    with pytest.raises(ModuleNotFoundError, match="chaos_test_no_such_dependency"):
        chaos_faults.available()


def test_every_size_counts_each_fault_class_and_the_options_override_them():
    assert set(COUNT_KEYS) == {"partitions", "net_latency", "net_resets", "storage_faults", "stops", "ooms"}
    for size, p in SIZES.items():
        assert all(p[k] >= 1 for k in COUNT_KEYS), size
    assert all(SIZES["tiny"][k] == 1 for k in COUNT_KEYS)
    assert all(SIZES["tiny"][k] < SIZES["full"][k] < SIZES["scale"][k] for k in COUNT_KEYS)
    opts = ChaosOptions("tiny", 0, stops=3, ooms=0, partitions=2)
    p = opts.plan(8)
    assert (p["stops"], p["ooms"], p["partitions"], p["net_latency"]) == (3, 0, 2, 1)
    assert chaos_docs.command_line(opts) == "rlstream chaos --size tiny --seed 0 --partitions 2 --stops 3 --ooms 0"


def test_availability_per_fault_class_on_a_timeline():
    """Steps end every 2 s from t0+2 to t0+200, with a hole from t0+40 to t0+70 (a SIGSTOP of the
    trainer at 35 s for 20 s) and none after t0+190; a disk_full at 100 s for 10 s that the trainer
    said on screen; a kill -9 of ours at 150 s; a weights_vanish at 189 s (no step after its window)."""
    t0 = 1_800_000_000.0
    ends = [t0 + t for t in range(2, 191, 2) if not 40 < t < 70]
    steps = [{"step": i, "time": t, "step_time_s": 1.0} for i, t in enumerate(ends)]
    done = [
        {
            "kind": "stop",
            "target": "trainer",
            "t": 35.0,
            "seconds": 20.0,
            "seen": ["this process was stopped for 20 s"],
        },
        {
            "kind": "disk_full",
            "target": "store",
            "t": 100.0,
            "seconds": 10.0,
            "seen": ["trainer/t0: disk full; paused"],
        },
        {"kind": "weights_vanish", "target": "v9", "t": 189.0, "seconds": 0.0, "seen": []},
        {"kind": "oom", "target": "reward-0", "t": 170.0, "seconds": 3.0,
         "seen": ["MemoryError", "supervisor: reward-0 was killed by the kernel's OOM killer (exit -9)"]},
    ]  # fmt: skip
    events = [
        {"event": "signal", "signal": "SIGKILL", "name": "reward-1", "time": t0 + 150, "cause": "chaos kill -9"},
        {"event": "signal", "signal": "SIGKILL", "name": "reward-0", "time": t0 + 160, "cause": "hung"},  # not ours
    ]
    broker = [{"t": 120.0, "down_s": 12.0, "stop_s": 1.0, "start_s": 2.0, "ok": True, "fault": "restart"}]
    said = [{"worker": "trainer/t0", "text": "disk full at /x (need 5 MB free, 1 MB left); paused",
             "start": t0 + 101.0, "end": t0 + 111.0},
            {"worker": "trainer/t0", "text": "weights store slow", "start": t0 + 152.0, "end": t0 + 153.0}]  # fmt: skip
    records = ca.fault_records(done, events, broker, t0)
    assert [r["kind"] for r in records] == ["stop", "disk_full", "broker", "kill", "oom", "weights_vanish"]
    rows = {r["kind"]: r for r in ca.by_fault_class(records, steps, said, t0)}
    assert rows["stop"] == {"kind": "stop", "n": 1, "roles_saw": ["trainer"], "pause_s": 30.0, "said": None}
    assert rows["disk_full"]["said"] == "t0: disk full at /x (need 5 MB free, 1 MB left); paused"
    assert rows["disk_full"]["roles_saw"] == ["t0"] and rows["disk_full"]["pause_s"] == 2.0
    assert rows["broker"]["n"] == 1 and rows["kill"]["n"] == 1
    # a kill of reward-1: the trainer's line at that moment is not about it; the broker's is anyone's
    assert rows["kill"]["said"] is None and rows["broker"]["said"] == "t0: weights store slow"
    assert rows["oom"]["said"].startswith("supervisor: reward-0 was killed") and rows["oom"]["roles_saw"] == [
        "reward-0"
    ]
    assert rows["weights_vanish"]["pause_s"] is None  # the trainer took no step after its window
    assert ca.fault_class_line(rows["stop"]) == ("stop: n=1 roles saw: trainer; longest pause 30 s; on screen: nothing")
    table = chaos_docs.by_fault_class(list(rows.values()))
    assert table.splitlines()[0] == "| fault class | n | roles saw | longest pause (s) | said on screen |"
    assert "| stop | 1 | trainer | 30 | – |" in table and "| weights_vanish | 1 | – | – | – |" in table


def test_the_docs_block_has_the_table_when_the_run_has_rows():
    from tests.test_chaos_docs import report

    r = report()
    assert "| fault class |" not in chaos_docs.block(r)
    r["by_fault_class"] = [{"kind": "oom", "n": 2, "roles_saw": ["reward-0"], "pause_s": 4.5, "said": "a | b"}]
    assert "| oom | 2 | reward-0 | 4.5 | a \\| b |" in chaos_docs.block(r)


def test_a_seeded_plan_is_the_same_twice(registry):
    a = FaultClasses(ctx([]), {"stops": 3}, 90.0, seed=4).faults
    b = FaultClasses(ctx([]), {"stops": 3}, 90.0, seed=4).faults
    assert [(f.at, f.kind) for f in a] == [(f.at, f.kind) for f in b]


@pytest.mark.parametrize("ends", ["interrupted", "failed", "ok"])
def test_every_fault_is_ended_before_the_roles_are_stopped(registry, monkeypatch, ends):
    """The harness's watch loop ends (Ctrl-C, a failed run, or ``ok`` with a fault still in force):
    the classes end their faults before the launcher stops the roles."""
    from rlstream.dev.chaos import _ChaosLauncher
    from rlstream.launcher import Launcher

    said: list[str] = []
    classes = FaultClasses(ctx(said), {"stops": 1}, 100.0, seed=0)
    classes.classes = [c for c in classes.classes if type(c) is PauseFaults]  # not the one whose close raises
    classes.classes[0].do(classes.faults[0], 1.0)

    def watch(self, sup, metrics, tick=None):
        if ends == "interrupted":
            raise KeyboardInterrupt
        return "failed: drain timed out" if ends == "failed" else "ok"

    monkeypatch.setattr(Launcher, "watch", watch)
    launcher = _ChaosLauncher.__new__(_ChaosLauncher)
    launcher.chaos = types.SimpleNamespace(classes=classes)
    if ends == "interrupted":
        with pytest.raises(KeyboardInterrupt):
            launcher.watch(None, None)
    else:
        assert launcher.watch(None, None) == ("ok" if ends == "ok" else "failed: drain timed out")
    assert not classes.busy and said == ["closed"] and classes.closed
