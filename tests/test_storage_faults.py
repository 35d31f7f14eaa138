"""Storage faults against a real broker and real filesystems: a full disk under the weights store or
the trainer's checkpoint dir (a small tmpfs, filled and then freed), a store that is slow and then
fails (``faultfile://``, ``pipeline.faultfs``), and published weights that vanish after their notice.

In every case the job pauses rather than corrupts: the previous version stays live, no notice names a
half-written version and no partial file stays behind, the trainer says the fault on screen
(``WorkerMetrics.set_fault``) and resumes by itself when the fault ends, and every sample is trained
in exactly one step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.test_trainer import TINY, ScoredProducer, read_topic, scored

G, N, STEPS = 1, 2, 3


@pytest.fixture
def tmpfs(tmp_path):
    """A 24 MB tmpfs at ``tmp_path/tmpfs`` (skipped with the reason if mounting is refused)."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)


def fill(d: Path, leave: int) -> Path:
    """Fill the disk holding ``d`` up to ``leave`` free bytes (a file, freed by deleting it)."""
    filler = d / "filler.bin"
    n = shutil.disk_usage(d).free - leave
    with open(filler, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, max(n, 1))
    return filler


def wait_for(cond, what: str, thread: threading.Thread, errors: list, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert not errors, f"trainer failed: {errors[0]!r}"
        assert thread.is_alive() or cond(), f"trainer ended while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


class TrainerRun:
    """A trainer in a thread of this process (rank 0, no watchdog), fed one group per step."""

    def __init__(self, cfg):
        from consumers.trainer.worker import Trainer

        self.cfg, self.stop, self.errors = cfg, threading.Event(), []
        self.trainer = Trainer(cfg, max_steps=STEPS)
        self.faults: list[str] = []
        self.sp = ScoredProducer(cfg)
        self.produced: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.trainer.run(self.stop)
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def start(self):
        self.thread.start()
        wait_for(lambda: self.trainer.metrics is not None, "the trainer's setup", self.thread, self.errors, 180)
        m = self.trainer.metrics
        said = m.set_fault

        def record(text):  # every fault line the trainer says, in order
            self.faults.append(text)
            return said(text)

        m.set_fault = record
        return self

    def feed(self, i: int) -> None:
        recs = [scored(f"g{i}", j, N, 0, float(j % 2), seq=i) for j in range(N)]
        self.produced |= {r["trajectory"]["trajectory_id"] for r in recs}
        self.sp.send(recs)

    def at_step(self, step: int) -> bool:
        return self.trainer.step >= step

    def finish(self) -> None:
        self.thread.join(180)
        assert not self.thread.is_alive(), "the trainer did not finish"
        assert not self.errors, self.errors

    def close(self) -> None:
        self.stop.set()
        self.thread.join(60)
        if self.sp is not None:
            self.sp.close()
            self.sp = None


def _config(make_config, *extra: str):
    return make_config(
        *TINY,
        "rl.max_staleness=8",
        f"rl.group_size={N}",
        f"rl.groups_per_step={G}",
        "topics.scored.partitions=1",
        "trainer.poll_timeout_s=0.2",
        "trainer.publish_every=1",
        "trainer.metrics_interval_s=0.5",
        *extra,
    )


def notices(cfg) -> list[dict]:
    return [r for name, r in read_topic(cfg, "control") if name == "WeightUpdate"]


def check_exactly_once(cfg, run: TrainerRun) -> None:
    """Every sample in exactly one committed step; versions 1..STEPS announced once each."""
    from consumers.trainer.state import read_steps_log

    entries = read_steps_log(Path(cfg.trainer.checkpoint_dir or Path(cfg.run_dir) / "trainer"))
    assert [e["step"] for e in entries] == list(range(1, STEPS + 1))
    used = [i for e in entries for i in e["used"]]
    assert len(used) == len(set(used)) and set(used) == run.produced  # 0 lost, 0 trained twice
    assert sorted(u["version"] for u in notices(cfg)) == list(range(1, STEPS + 1))


def leftovers(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*.tmp-*"))


@pytest.mark.kafka
@pytest.mark.parametrize("where", ["store", "trainer"])
def test_a_full_disk_pauses_the_trainer_and_it_resumes_when_space_is_freed(make_config, tmpfs, where):
    """The disk under the weights store (``store``) or under the trainer's own checkpoint dir
    (``trainer``) fills up after version 1: step 2's write fails with ENOSPC. The trainer removes what
    it half-wrote, says ``disk full at <dir> (need N MB free, M MB left); paused``, publishes no notice
    for version 2 and commits no step 2 (version 1 stays live), retries, and once the filler is
    deleted it resumes by itself (the fault line cleared) and the job ends with every sample trained once."""
    key = "checkpoint_store" if where == "store" else "trainer.checkpoint_dir"
    cfg = _config(make_config, f"{key}={tmpfs}")
    run = TrainerRun(cfg).start()
    try:
        run.feed(0)
        wait_for(lambda: run.at_step(1) and len(notices(cfg)) == 1, "version 1", run.thread, run.errors)
        if where == "store":
            size = sum(p.stat().st_size for p in (tmpfs / "v00000001").rglob("*") if p.is_file())
        else:
            size = sum(p.stat().st_size for p in (tmpfs / "ckpts").rglob("*") if p.is_file())
        filler = fill(tmpfs, size // 3)
        run.feed(1)
        wait_for(lambda: any(f and f.startswith("disk full at") for f in run.faults), "the disk-full fault line",
                 run.thread, run.errors)  # fmt: skip
        text = next(f for f in run.faults if f)
        assert str(tmpfs) in text and "MB free" in text and "MB left); paused" in text, text
        time.sleep(3)  # a few tries while it stays full
        assert run.trainer.metrics.fault == text  # still paused, still saying it
        assert [u["version"] for u in notices(cfg)] == [1]  # no notice for the half-written version
        ptr_root = Path(cfg.trainer.checkpoint_dir or Path(cfg.run_dir) / "trainer")
        assert json.loads((ptr_root / "checkpoint.json").read_text())["step"] == 1  # step 2 not committed
        assert leftovers(tmpfs) == []  # no partial file
        if where == "store":
            assert not (tmpfs / "v00000002").exists() or not any((tmpfs / "v00000002").iterdir())
        assert run.trainer.step == 2  # trained, waiting to be written (not trained again later)
        filler.unlink()
        wait_for(lambda: run.trainer.metrics.fault is None, "the trainer to resume", run.thread, run.errors)
        assert run.faults[-1] is None  # cleared: the launcher prints "resumed after N s"
        print("fault lines:", run.faults)
        run.feed(2)
        run.finish()
        check_exactly_once(cfg, run)
        assert leftovers(tmpfs) == []
    finally:
        run.close()


@pytest.mark.kafka
def test_a_trainer_paused_on_a_full_disk_is_not_taken_for_hung(make_config, cli_env, tmpfs, tmp_path):
    """``rlstream train`` (a process of its own, with its watchdog at 5 s) pauses on a full store for
    three times its watchdog limit: it is not declared hung, its log says the fault, and once space
    is freed it finishes its steps and exits 0."""
    from tests.conftest import rlstream_cmd

    sets = [*TINY, "rl.max_staleness=8", f"rl.group_size={N}", f"rl.groups_per_step={G}",
            "topics.scored.partitions=1", "trainer.poll_timeout_s=0.2", "trainer.publish_every=1",
            f"trainer.max_steps={STEPS}", f"checkpoint_store={tmpfs}", "liveness.watchdog_s=5"]  # fmt: skip
    cfg = _config(make_config, *sets)
    sp = ScoredProducer(cfg)
    log = tmp_path / "trainer.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*rlstream_cmd(), "train", *[x for s in sets for x in ("--set", s)]], env=cli_env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        sp.send([scored("g0", j, N, 0, float(j % 2), seq=0) for j in range(N)])
        deadline = time.monotonic() + 180
        while len(notices(cfg)) < 1:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "timed out waiting for version 1"
            time.sleep(0.5)
        size = sum(p.stat().st_size for p in (tmpfs / "v00000001").rglob("*") if p.is_file())
        filler = fill(tmpfs, size // 3)
        sp.send([scored("g1", j, N, 0, float(j % 2), seq=1) for j in range(N)])
        deadline = time.monotonic() + 120
        while "disk full at" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "timed out waiting for the fault line"
            time.sleep(0.2)
        time.sleep(15)  # three watchdog limits
        assert proc.poll() is None, log.read_text()[-4000:]
        assert [u["version"] for u in notices(cfg)] == [1]
        filler.unlink()
        sp.send([scored("g2", j, N, 0, float(j % 2), seq=2) for j in range(N)])
        assert proc.wait(180) == 0, log.read_text()[-4000:]
        text = log.read_text()
        assert "is hung" not in text and 'fault="ended"' in text, text[-4000:]
        assert sorted(u["version"] for u in notices(cfg)) == list(range(1, STEPS + 1))
    finally:
        sp.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.kafka
def test_a_slow_then_failing_store_is_said_and_ridden_out(make_config, tmp_path, monkeypatch):
    """A ``faultfile://`` store that answers slowly (each open 1.5 s, past ``liveness.store_slow_s``)
    and then fails every operation with EIO: the trainer says ``weights store slow: ...`` while the
    write lasts, then ``weights store failing at ...; retrying``, publishes nothing meanwhile, and
    goes on once the store answers again."""
    from pipeline import faultfs

    orders = tmp_path / "orders.json"
    monkeypatch.setenv(faultfs.ENV, str(orders))
    store = tmp_path / "store"
    cfg = _config(make_config, f"checkpoint_store=faultfile://{store}", "liveness.store_slow_s=1")
    run = TrainerRun(cfg).start()
    try:
        run.feed(0)
        wait_for(lambda: run.at_step(1) and len(notices(cfg)) == 1, "version 1", run.thread, run.errors)
        faultfs.write_orders(orders, {"delay_s": 1.5, "ops": ["open"]})
        run.feed(1)
        wait_for(lambda: any(f and f.startswith("weights store slow:") for f in run.faults), "the slow line",
                 run.thread, run.errors)  # fmt: skip
        faultfs.write_orders(orders, {"fail": True})
        wait_for(lambda: any(f and f.startswith("weights store failing at") for f in run.faults),
                 "the failing line", run.thread, run.errors)  # fmt: skip
        time.sleep(2)
        assert [u["version"] for u in notices(cfg)] == [1]
        faultfs.write_orders(orders, None)
        wait_for(lambda: run.trainer.metrics.fault is None and len(notices(cfg)) == 2, "the trainer to go on",
                 run.thread, run.errors)  # fmt: skip
        run.feed(2)
        run.finish()
        check_exactly_once(cfg, run)
        assert leftovers(store) == []
    finally:
        faultfs.write_orders(orders, None)
        run.close()


@pytest.mark.kafka
def test_weights_that_vanish_after_their_notice_are_said_and_superseded(make_config, caplog):
    """The newest weights are deleted right after their notice: a rollout worker's weight sync says
    they are unavailable and retries, the job goes on (the trainer publishes the next version), and the
    vanished version is dead-lettered as superseded while the next one is loaded."""
    import logging

    from producers.weights import WeightSync
    from tests.test_weights_retry import StoreEngine, _until

    cfg = _config(make_config)
    run = TrainerRun(cfg).start()
    sync = None
    try:
        run.feed(0)
        wait_for(lambda: run.at_step(1) and len(notices(cfg)) == 1, "version 1", run.thread, run.errors)
        shutil.rmtree(Path(cfg.store) / "v00000001")  # gone after its notice
        engine = StoreEngine()
        sync = WeightSync(cfg, "rollout-0", engine)
        with caplog.at_level(logging.WARNING):
            _until(sync, lambda: "weights v1 unavailable" in caplog.text, "the follower to say v1 is gone")
            run.feed(1)  # the job goes on: the trainer publishes version 2
            _until(sync, lambda: sync.loadable is not None and sync.loadable[0]["version"] == 2, "version 2")
        sync.load()
        assert engine.version == 2
        dlq = [r for name, r in read_topic(cfg, "dlq") if name == "DeadLetter"]
        assert any("unavailable" in r["reason"] and "superseded" in r["reason"] for r in dlq), dlq
        run.feed(2)
        run.finish()
        check_exactly_once(cfg, run)
    finally:
        if sync is not None:
            sync.close()
        run.close()


def test_the_chaos_storage_faults_fill_slow_and_delete_the_store(tmp_path):
    """``rlstream chaos``'s storage faults on their own: the plan mounts a tmpfs on the (empty) store
    dir, ``disk_full`` fills it so that a write fails with ENOSPC and frees it when its time is up,
    ``store_slow`` slows and then fails the ``faultfile://`` store, ``weights_vanish`` deletes the
    newest version; ``close`` ends everything and unmounts."""
    import errno
    import random
    from types import SimpleNamespace

    import fsspec

    from pipeline import faultfs
    from rlstream.config import load_config
    from rlstream.dev.chaos_storage import StorageFaults, settings

    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run_dir={run_dir}", *(f"{k}={v}" for k, v in settings(run_dir).items())], environ={})
    said: list[str] = []
    ctx = SimpleNamespace(cfg=cfg, launcher=None, run_dir=run_dir, broker_ops=None, say=said.append, rng=None)
    sf = StorageFaults(ctx)
    old_env = os.environ.get(faultfs.ENV)
    try:
        faults = sf.plan({"storage_faults": 3}, random.Random(0), 300.0)
        assert sorted(f.kind for f in faults) == sorted(sf.kinds) or not sf.mounted, said
        if not sf.mounted:
            pytest.skip(f"cannot mount a tmpfs here: {said}")
        store = sf.dir
        by_kind = {f.kind: f for f in faults}
        assert sf.do(by_kind["disk_full"], 0.0) is None  # nothing published yet
        for v in (1, 2):
            (store / f"v{v:08d}").mkdir()
            (store / f"v{v:08d}" / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024))
        out = sf.do(by_kind["disk_full"], 10.0)
        assert out.startswith("disk full at") and sf.busy, out
        with pytest.raises(OSError) as e:
            (store / "v00000003").mkdir()
            (store / "v00000003" / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024))
        assert e.value.errno == errno.ENOSPC
        shutil.rmtree(store / "v00000003")
        sf.poll(10.0 + by_kind["disk_full"].arg)
        assert not sf.busy and sf.done[-1]["kind"] == "disk_full"
        (store / "v00000003").mkdir()
        (store / "v00000003" / "model.safetensors").write_bytes(os.urandom(3 * 1024 * 1024))

        fs, path = fsspec.core.url_to_fs(cfg.store)
        slow = by_kind["store_slow"]
        assert sf.do(slow, 100.0).startswith("weights store slow")
        t0 = time.monotonic()
        assert fs.exists(f"{path}/v00000003")
        assert time.monotonic() - t0 >= 1.5  # slow
        sf.poll(100.0 + slow.arg / 2)
        with pytest.raises(OSError):
            fs.ls(path)  # failing
        sf.poll(100.0 + slow.arg)
        assert not sf.busy and fs.ls(path)

        assert sf.do(by_kind["weights_vanish"], 200.0) == f"deleted weights v3 ({store / 'v00000003'}) after its notice"
        assert not (store / "v00000003").exists() and (store / "v00000002").exists()
        assert [d["kind"] for d in sf.done] == ["disk_full", "store_slow", "weights_vanish"]
    finally:
        sf.close()
        if old_env is None:
            os.environ.pop(faultfs.ENV, None)
        else:
            os.environ[faultfs.ENV] = old_env
    assert not sf.mounted


def test_the_guard_gives_up_loudly_past_its_bound_and_never_retries_a_user_mistake(tmp_path):
    """A disk that stays full past ``liveness.disk_full_timeout_s`` (a store that keeps failing past
    ``liveness.outage_s``) ends in one ``StorageFault`` naming the directory and the key; a failed
    try's leftovers are removed each time; a permission error is raised at once, not retried."""
    import errno

    from pipeline.config import LivenessConfig
    from pipeline.store_guard import StorageFault, StoreGuard

    guard = StoreGuard(LivenessConfig(disk_full_timeout_s=1.5, outage_s=1))
    cleaned = []

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    t0 = time.monotonic()
    with pytest.raises(StorageFault) as e:
        guard.call(full, "writing weights v3", str(tmp_path / "v3"), 5 << 20, lambda: cleaned.append(1))
    msg = str(e.value)
    assert f"disk full at {tmp_path / 'v3'} (need 5 MB free" in msg and "liveness.disk_full_timeout_s=1.5" in msg, msg
    assert len(cleaned) >= 2 and time.monotonic() - t0 < 30

    def failing():
        raise OSError(errno.EIO, "I/O error")

    with pytest.raises(StorageFault, match=r"weights store failing at .*liveness.outage_s=1"):
        guard.call(failing, "writing weights v3", "s3://bucket/job")

    tries = []

    def denied():
        tries.append(1)
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(PermissionError):
        guard.call(denied, "writing weights v3", str(tmp_path))
    assert tries == [1]


@pytest.mark.kafka
def test_a_store_that_cannot_remove_old_versions_does_not_stop_the_trainer(make_config, tmp_path, monkeypatch, caplog):
    """Removing old weight versions is clean-up: a store whose deletes fail (EIO) leaves them there,
    the trainer says so in its log and goes on (a crash here once restarted the trainer in a loop)."""
    from pipeline import faultfs

    orders = tmp_path / "orders.json"
    monkeypatch.setenv(faultfs.ENV, str(orders))
    store = tmp_path / "store"
    cfg = _config(make_config, f"checkpoint_store=faultfile://{store}", "trainer.keep_weight_versions=1")
    faultfs.write_orders(orders, {"fail": True, "ops": ["rm"]})
    run = TrainerRun(cfg).start()
    try:
        for i in range(STEPS):
            run.feed(i)
        run.finish()
        check_exactly_once(cfg, run)
        assert "could not remove old versions" in caplog.text
        assert len([p for p in store.iterdir() if p.name.startswith("v")]) == STEPS  # none removed
    finally:
        faultfs.write_orders(orders, None)
        run.close()


def test_one_thread_watches_every_write_and_says_only_the_slow_ones():
    """``SlowWatch``: many quick writes start no thread each and say nothing; a write past the
    limit is said once while it runs, and the watch goes on to the next write."""
    from pipeline.store_guard import SlowWatch

    lines: list = []
    watch = SlowWatch(1.0, lines.append)
    before = threading.active_count()
    for _ in range(200):
        with watch.watch("writing weights v1", "/store") as said:
            pass
        assert not said.is_set()
    assert threading.active_count() <= before + 1 and lines == []
    with watch.watch("writing weights v2", "/store") as said:
        assert said.wait(60), "a write past the limit was not said"
    assert lines == ["weights store slow: writing weights v2 at /store has taken over 1 s"]
    with watch.watch("writing weights v3", "/store") as said:
        assert said.wait(60)  # the next slow write is said too
    assert len(lines) == 2 and threading.active_count() <= before + 1
