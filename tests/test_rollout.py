"""Rollout workers on a real broker: weight reloads (drain, interrupt), admission control with
k = 0, dead letters, commits. Multi-worker and kill -9 runs are in test_rollout_cluster.py."""

import threading
import time

import pytest
import torch

from pipeline import codec
from pipeline.control import required_version
from pipeline.kafka import Consumer, Producer, client_conf
from pipeline.models import load_model, materialize
from producers import feed
from producers.rollout import RolloutWorker
from tests.rollout_helpers import end_offsets, forcing_state_dict, publish_version, read_topic

pytestmark = pytest.mark.kafka
DATA = "tests/data/prompts.jsonl"


class WorkerThread:
    """A RolloutWorker in a thread; ``join`` re-raises what killed it."""

    def __init__(self, cfg, before=None):
        self.worker = RolloutWorker(cfg)
        if before is not None:
            before(self.worker)  # e.g. wrap a method, before the worker thread starts
        self.stop = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.worker.run(self.stop)
        except BaseException as exc:
            self.error = exc

    def join(self, timeout=120):
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error:
            raise self.error


def run_until_idle(cfg, timeout: float = 120) -> WorkerThread:
    """Run a RolloutWorker until it exits on its own (``rollout.exit_when_idle_s``); re-raises what
    killed it."""
    w = WorkerThread(cfg)
    w.thread.join(timeout)
    w.join()
    return w


def wait_for(pred, timeout=60.0, what="condition", worker=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker is not None and worker.error:
            raise worker.error
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    message = f"timed out waiting for {what() if callable(what) else what}"
    if worker is not None:  # a failed test does not leave its worker running
        worker.stop.set()
    raise AssertionError(message)


def engine_state(w) -> str:
    """The rollout worker's generation state, for a failure message."""
    ww, eng = w.worker, w.worker.engine
    rows = [len(r.tokens) for r in eng.rows] if eng is not None else None
    return (f"engine rows (tokens) {rows}, running {len(ww.running)}, ready {len(ww.ready)}, "
            f"stats {ww.stats}, held {ww.hold.held() if ww.hold else None}, queued {ww.queue.samples()}")  # fmt: skip


def gate_at(tokens: int, published: threading.Event, timeout: float = 240.0):
    """A ``WorkerThread`` hook: the worker's loop waits (up to ``timeout``) once every running
    sample has ``tokens`` tokens, until ``published`` is set. Without it a test thread starved on a
    loaded machine could miss the window and find every sample finished (seen about 1 in 10 CI
    runs: "timed out waiting for generation under way", every row done)."""

    def hook(worker):
        work = worker._work_once

        def _work_once(consume):
            deadline = time.monotonic() + timeout
            while not published.is_set() and time.monotonic() < deadline:
                rows = worker.engine.rows if worker.engine is not None else []
                if not rows or min(len(r.tokens) for r in rows) < tokens:
                    break
                worker.beat()
                published.wait(0.05)
            work(consume)

        worker._work_once = _work_once

    return hook


def trajectories(cfg, n=0, timeout=60):
    return [r for _, r in read_topic(cfg, "rollouts", "Trajectory", n, timeout)]


def committed(cfg):
    topic = cfg.topics.name("prompts")
    c = Consumer(client_conf(cfg, "test", kind="consumer"), group_id=cfg.rollout.group_id)
    try:
        parts = [(topic, p) for p in range(cfg.topics.prompts.partitions)]
        return {p: off for (_, p), off in c.committed(parts, timeout=10).items()}
    finally:
        c.close()


def z_token(cfg):
    from pipeline.models import load_tokenizer

    return load_tokenizer(materialize(cfg.model)).convert_tokens_to_ids("Z")


def base_state(cfg):
    return load_model(materialize(cfg.model)).state_dict()


def test_drain_reload_changes_generation_and_tags_versions(make_config):
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=6", "rl.group_size=4", "rl.max_staleness=100",
        "rollout.max_new_tokens=24", "rollout.reload_policy=drain", "rollout.metrics_interval_s=0.5",
    )  # fmt: skip
    feed.run(cfg)
    w = WorkerThread(cfg)
    wait_for(lambda: len(trajectories(cfg, 0, 0)) >= 24, what="v0 trajectories", worker=w)
    z = z_token(cfg)
    publish_version(cfg, 1, forcing_state_dict(base_state(cfg), z))
    wait_for(lambda: w.worker.engine.version == 1, what="v1 loaded", worker=w)
    cfg.feed.limit = 0
    feed.run(cfg)  # the remaining 6 groups, fed after v1 is loaded
    got = wait_for(lambda: (t := trajectories(cfg, 48, 0)) and len(t) >= 48 and t, what="48 trajectories", worker=w)
    w.join()
    assert len({t["trajectory_id"] for t in got}) == 48 == len(got)
    for t in got:
        toks = list(codec.unpack_i32(t["response_tokens"]))
        assert t["version_min"] == t["version_max"]  # drain: no sample spans two versions
        if t["group_seq"] >= 6:
            assert t["version_min"] == 1
        if t["version_min"] == 1:
            assert set(toks) == {z} and len(toks) == 24
        else:
            assert set(toks) != {z}
    metrics = [r for _, r in read_topic(cfg, "metrics", "MetricEvent")]
    loads = [m for m in metrics if m["metrics"].get("weight_loads") == 1.0]
    assert loads and loads[0]["version"] == 1 and loads[0]["metrics"]["loaded_version"] == 1
    assert loads[0]["metrics"]["weight_load_ms"] > 0


def test_interrupt_resumes_partial_rollouts_under_new_weights(make_config):
    """Six samples, not three: the random model ends a sample with EOS within its first 20 tokens
    about 1 time in 5 (measured, 2000 draws), and the gate below holds only samples that reach 20.
    With three, all of them ended early and nothing was interrupted about 1 run in 125 (CI failed
    so: "generation under way ... rows []", 3 trajectories); with six, about 1 in 16,000."""
    n = 6
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=1", f"rl.group_size={n}", "rl.max_staleness=100",
        "model.type=tiny", "model.max_position_embeddings=1024", "rollout.max_new_tokens=1000", "rollout.reload_policy=interrupt",
    )  # fmt: skip
    feed.run(cfg)
    z = z_token(cfg)
    forcing = forcing_state_dict(base_state(cfg), z)  # ready before generation starts
    producer = Producer(client_conf(cfg, "test", kind="producer"))
    producer.partitions(cfg.topics.name("control"))  # connected before the race starts
    published = threading.Event()
    w = WorkerThread(cfg, before=gate_at(20, published))

    def rows():  # the engine exists once the worker is set up
        return w.worker.engine.rows if w.worker.engine is not None else []

    wait_for(
        lambda: rows() and min(len(r.tokens) for r in rows()) >= 20,
        timeout=600,
        what=lambda: f"generation under way: {engine_state(w)}",
        worker=w,
    )
    try:
        publish_version(cfg, 1, forcing, producer)
    finally:
        published.set()
    producer.close()
    got = wait_for(lambda: (t := trajectories(cfg, n, 0)) and len(t) >= n and t, timeout=600, worker=w)
    w.join()
    assert w.worker.stats["loads"] == 1 and len(got) == n
    spanning = [t for t in got if t["version_min"] < t["version_max"]]
    assert spanning, "no trajectory was interrupted"
    for t in spanning:
        assert (t["version_min"], t["version_max"]) == (0, 1)
        toks = list(codec.unpack_i32(t["response_tokens"]))
        lps = list(codec.unpack_f32(t["logprobs"]))
        (mark0, mark1) = [tuple(map(int, m.split("@"))) for m in t["metadata"]["versions"].split(",")]
        switch = mark1[0]
        assert mark0 == (0, 0) and mark1[1] == 1 and 20 <= switch < len(toks) == 1000
        assert set(toks[switch:]) == {z} and all(lp > -1e-3 for lp in lps[switch:])  # new weights force Z
        assert set(toks[:switch]) != {z}  # the old weights' tokens are kept, with their logprobs
        assert sum(lps[:switch]) < -switch  # random-init model: about -log(V) per token


@pytest.mark.parametrize("finished", [True, False], ids=["all", "in_flight"])
def test_interrupt_restarts_samples_the_new_version_makes_stale(make_config, finished):
    """k = 0: once v1 loads, every sample begun under v0 would be dropped by the trainer, so a
    sample still in flight is generated again from its prompt under v1 (rollout.stale_restarts)
    instead of resumed. The random model may end some samples with EOS before the load: with
    rollout.restart_scope = "all" those are held (their group is not done) and generated again too,
    so the whole group comes out under v1; with "in_flight" they are published under v0."""
    n, begun = 4, 8  # four samples, so that the random model's early EOS ends all of them rarely
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=1", f"rl.group_size={n}", "rl.max_staleness=0",
        "model.type=tiny", "model.max_position_embeddings=1024", "rollout.max_new_tokens=1000",
        "rollout.reload_policy=interrupt", "rollout.metrics_interval_s=0.3", "rollout.stale_restarts=1",
        f"rollout.restart_scope={'all' if finished else 'in_flight'}",
    )  # fmt: skip
    feed.run(cfg)
    z = z_token(cfg)
    forcing = forcing_state_dict(base_state(cfg), z)
    producer = Producer(client_conf(cfg, "test", kind="producer"))
    producer.partitions(cfg.topics.name("control"))
    published = threading.Event()
    w = WorkerThread(cfg, before=gate_at(begun, published))

    def rows():
        return w.worker.engine.rows if w.worker.engine is not None else []

    wait_for(
        lambda: rows() and min(len(r.tokens) for r in rows()) >= begun,
        timeout=600,
        what=lambda: engine_state(w),
        worker=w,
    )
    try:
        publish_version(cfg, 1, forcing, producer)
    finally:
        published.set()
    producer.close()
    got = wait_for(lambda: (t := trajectories(cfg, n, 0)) and len(t) >= n and t, timeout=600, worker=w)
    w.join()
    assert w.worker.stats["loads"] == 1 and len(got) == n
    restarted = [t for t in got if t["version_min"] == 1]
    assert restarted, "no sample was in flight at the load"
    assert all(t["version_max"] == t["version_min"] for t in got)  # none resumed across versions
    for t in restarted:  # nothing of v0 is left: a whole response of v1
        toks = list(codec.unpack_i32(t["response_tokens"]))
        assert t["metadata"]["versions"] == "0@1" and set(toks) == {z} and len(toks) == 1000
    last = [r["metrics"] for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "rollout"][-1]
    again = last["restarted_samples"] + last.get("regenerated_samples", 0)
    assert again == len(restarted)
    assert last["restart_discarded_tokens"] >= begun * last["restarted_samples"]
    if finished:
        assert len(restarted) == n  # the samples that had ended under v0 were generated again
    else:
        assert "regenerated_samples" not in last


def fed_at_k0(make_config, G: int, n: int, *sets: str):
    """A k = 0 config (``G`` groups of ``n`` a step) and six prompts fed; returns the config and the
    prompt messages by group_seq."""
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=6", f"rl.group_size={n}", f"rl.groups_per_step={G}",
        "rl.max_staleness=0", *sets,
    )  # fmt: skip
    feed.run(cfg)
    return cfg, {r["group_seq"]: m for m, r in read_topic(cfg, "prompts", "Prompt", 6)}


def test_k0_admits_no_group_before_its_version_is_loaded(make_config):
    G, n = 2, 2
    cfg, prompts = fed_at_k0(make_config, G, n, "rollout.max_new_tokens=16", "rollout.metrics_interval_s=0.3")
    base = base_state(cfg)  # first: transformers' lazy imports raced the worker thread's (run alone: ImportError)
    w = WorkerThread(cfg)
    for version in (0, 1, 2):
        want = (version + 1) * G * n
        got = wait_for(lambda want=want: (t := trajectories(cfg, want, 0)) and len(t) >= want and t, worker=w)
        time.sleep(1.5)  # give a wrongly admitted group time to show up
        got = trajectories(cfg, 0, 0)
        assert len(got) == want and max(t["group_seq"] for t in got) == (version + 1) * G - 1
        if version < 2:  # the next step's groups are held, and their offsets not committed
            held = prompts[(version + 1) * G]
            assert committed(cfg)[held.partition()] <= held.offset()
            perturbed = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
            publish_version(cfg, version + 1, perturbed)
    w.join()
    for t in got:
        assert t["version_min"] >= required_version(t["group_seq"], 0, G)
        assert t["version_min"] == t["group_seq"] // G  # each step's groups at exactly that version
    ends = end_offsets(cfg, cfg.topics.name("prompts"))
    assert all(committed(cfg)[p] == hi for p, hi in ends.items() if hi > 0)


def test_an_idle_worker_loads_new_weights_without_waiting_out_its_prompt_poll(make_config):
    """k = 0 with rollout.poll_timeout_s = 10: once version 0's groups are out, every other prompt is
    held, so the worker is idle in a prompt wait of 10 s. rl.control is followed during that wait:
    version 1's groups start soon after its notice, not when the wait ends (a batch consume, which
    waits out its timeout, took up to 10 s here)."""
    G, n = 2, 2
    cfg, _ = fed_at_k0(make_config, G, n, "rollout.max_new_tokens=4", "rollout.poll_timeout_s=10")
    w = WorkerThread(cfg)
    wait_for(lambda: len(trajectories(cfg, 0, 0)) >= G * n, 120, "version 0's groups", worker=w)
    wait_for(lambda: not (w.worker.running or w.worker.ready), 120, "the worker idle", worker=w)
    time.sleep(0.5)  # into the prompt wait
    update = publish_version(cfg, 1, base_state(cfg))
    got = wait_for(
        lambda: [t for t in trajectories(cfg, 0, 0) if t["version_min"] == 1], 120, "version 1's groups", worker=w
    )
    started_after_s = (min(t["gen_started_at_ms"] for t in got) - update["created_at_ms"]) / 1000
    w.join()
    assert started_after_s < 7.0, f"version 1's first sample started {started_after_s:.1f} s after its notice"


def test_bad_prompts_go_to_the_dlq_and_the_worker_goes_on(make_config):
    cfg = make_config(
        f"feed.source={DATA}", "rl.group_size=2", "rl.max_staleness=100", "rollout.max_prompt_tokens=30",
        "rollout.max_new_tokens=8", "rollout.exit_when_idle_s=2",
    )  # fmt: skip
    topic = cfg.topics.name("prompts")
    good = {"prompt_id": "ok", "group_id": "ok@e0", "group_seq": 0, "task": "copy", "text": "hi", "group_size": 2,
            "sample_count": 2, "created_at_ms": 1}  # fmt: skip
    wrong_schema = codec.encode("Command", {"name": "x", "created_at_ms": 1})
    sent = [
        (b"k-garbage", b"\x00not avro", "decode"),
        (b"k-schema", wrong_schema, "schema"),
        (b"k-long", codec.encode("Prompt", {**good, "group_id": "long@e0", "text": "x" * 31}), "too_long"),
        (b"k-range", codec.encode("Prompt", {**good, "group_id": "r@e0", "sample_start": 1}), "invalid"),
        (b"ok@e0", codec.encode("Prompt", good), None),
        (b"k-trunc", codec.encode("Prompt", good)[:-3], "decode"),
        (b"ok2@e0", codec.encode("Prompt", {**good, "group_id": "ok2@e0", "group_seq": 1}), None),
    ]
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for key, value, _ in sent:
            p.produce(topic, value, key=key, partition=3, headers={"h": b"v"})
    w = run_until_idle(cfg)
    assert w.worker.consumer._conf["session.timeout.ms"] == cfg.rollout.session_timeout_ms  # reaches the client
    dlq = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 5)]
    assert [(d["key"], d["value"], d["error_type"]) for d in dlq] == [(k, v, e) for k, v, e in sent if e]
    assert [d["source_offset"] for d in dlq] == [i for i, s in enumerate(sent) if s[2]]
    assert all(d["source_topic"] == topic and d["source_partition"] == 3 and d["headers"] == {"h": b"v"} for d in dlq)
    assert "31 tokens" in dlq[2]["reason"]
    got = trajectories(cfg, 4)
    assert sorted(t["trajectory_id"] for t in got) == ["ok2@e0/0", "ok2@e0/1", "ok@e0/0", "ok@e0/1"]
    assert committed(cfg)[3] == len(sent)  # committed past every bad message


def test_idle_time_counts_from_the_group_join_not_from_the_subscription(make_config):
    """A group join slower than ``exit_when_idle_s`` (here held up by a member that stops polling,
    as a loaded machine holds one up): the worker waits for its share and generates the prompts
    instead of leaving idle before the join gives it partitions. A worker the group gives nothing
    (the one-partition topic's owner runs on) leaves after ``startup_timeout_s``."""
    cfg_args = (
        f"feed.source={DATA}", "feed.limit=2", "rl.group_size=2", "rl.max_staleness=100", "rollout.max_new_tokens=8",
        "topics.prompts.partitions=1", "rollout.exit_when_idle_s=2", "liveness.startup_timeout_s=20",
    )  # fmt: skip
    cfg = make_config(*cfg_args)
    feed.run(cfg)
    topic = cfg.topics.name("prompts")
    holder = Consumer(client_conf(cfg, "test", kind="consumer"), group_id=cfg.rollout.group_id)
    got = threading.Event()
    holder.subscribe([topic], on_assign=lambda _c, parts: parts and got.set())
    try:
        deadline = time.monotonic() + 120
        while not got.is_set() and time.monotonic() < deadline:
            holder.poll(0.2)
        assert got.is_set(), "the holder never joined"
        w = WorkerThread(cfg)  # its join waits for the holder, which is not polling
        time.sleep(5)  # longer than exit_when_idle_s, which counts from an assignment only
        assert w.thread.is_alive(), "the worker left before its group join answered"
    finally:
        holder.close()  # leaves the group: the worker's join answers with the partition
    w.thread.join(180)
    w.join()
    assert len(trajectories(cfg, 4)) == 4 and w.worker.stats["trajectories"] == 4
    assert sum(committed(cfg).values()) == 2
    owner = WorkerThread(make_config(*cfg_args[:-2], "rollout.exit_when_idle_s=0", cfg_args[-1], create=False))
    wait_for(lambda: owner.worker._assigned_once, 180, "the partition's owner", owner)
    t0 = time.monotonic()
    spare = WorkerThread(cfg)  # given nothing while the owner runs: leaves at startup_timeout_s, not at 2 s
    spare.thread.join(240)
    left_after = time.monotonic() - t0
    spare.join()
    owner.join()
    assert cfg.liveness.startup_timeout_s <= left_after < 240 and not spare.worker.stats["trajectories"]


def test_a_worker_whose_engine_fails_stops_with_the_error_instead_of_draining(make_config):
    """The engine raises with samples in flight and has lost them (the hf engine did, on an empty
    prompt): the worker's run ends with that error. Its final revoke used to wait for those samples
    to finish, beating the watchdog, so the error was never logged and the process hung until a
    SIGTERM's shutdown limit."""
    cfg = make_config(f"feed.source={DATA}", "rl.group_size=2", "rl.max_staleness=100", "rollout.max_new_tokens=8")
    feed.run(cfg)

    broke = threading.Event()

    def broken_engine(worker):
        setup = worker.setup

        def setup_then_break():
            setup()

            def step(timeout=0.0):
                if not broke.is_set():
                    broke.set()
                    raise RuntimeError("engine broke")
                return []  # what it held is gone

            worker.engine.step = step

        worker.setup = setup_then_break

    w = WorkerThread(cfg, before=broken_engine)
    w.thread.join(120)
    assert not w.thread.is_alive(), "the failed worker hung in its final revoke"
    assert isinstance(w.error, RuntimeError) and str(w.error) == "engine broke"


@pytest.mark.parametrize("prefetch", [0, 4])
def test_lookahead_keeps_at_most_prefetch_samples_queued_beyond_the_free_slots(make_config, prefetch):
    """rollout.prefetch_samples: admitted samples waiting in ``ready`` stay within the look-ahead
    (plus the rest of one message), and a look-ahead is used while the engine is busy."""
    n = 2
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=8", f"rl.group_size={n}", "rl.max_staleness=100",
        "rollout.max_inflight=1", f"rollout.prefetch_samples={prefetch}", "rollout.max_new_tokens=4",
        'rollout.engine={type = "sim", token_latency_s = 0.1, sigma = 0, median_tokens = 4}',
    )  # fmt: skip
    feed.run(cfg)
    w = WorkerThread(cfg)
    seen = []
    deadline = time.monotonic() + 300
    while len(trajectories(cfg, 0, 0)) < 8 * n and time.monotonic() < deadline:
        if w.error:
            raise w.error
        seen.append((len(w.worker.ready), len(w.worker.running)))
        time.sleep(0.05)
    w.join()
    assert len({t["trajectory_id"] for t in trajectories(cfg, 8 * n)}) == 8 * n
    assert max(r for r, _ in seen) <= prefetch + n - 1, seen
    busy_queue = max((r for r, running in seen if running), default=0)
    assert busy_queue >= (prefetch if prefetch else 1), seen  # the look-ahead (or a message's rest) waits


def test_the_prompt_queue_stays_within_queue_samples_and_admits_the_oldest_group_first(make_config):
    """rollout.queue_samples bounds the consumed, not yet admitted messages (a partition whose share
    is full is paused; one consume may overshoot a share, which another partition's first message
    then overshoots the total by), and each admission takes the oldest group at the heads of the
    partition queues. Every sample is still generated exactly once and every offset committed."""
    n, limit, parts = 2, 4, 2
    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=8", f"rl.group_size={n}", "rl.max_staleness=100", f"topics.prompts.partitions={parts}",
        "rollout.max_inflight=1", "rollout.prefetch_samples=0", f"rollout.queue_samples={limit}",
        "rollout.max_new_tokens=4", 'rollout.engine={type = "sim", token_latency_s = 0.05, sigma = 0, median_tokens = 4}',
    )  # fmt: skip
    feed.run(cfg)
    queued, admitted = [], []

    def spy(worker):
        release, admit = worker._release, worker._admit

        def _release():
            queued.append(worker.queue.samples())
            release()

        def _admit(tp, offset, prompt, gen):  # its message has just left the head of its queue
            heads = [p["group_seq"] for p in worker.queue.heads()]
            admitted.append((prompt["group_seq"], heads))
            admit(tp, offset, prompt, gen)

        worker._release, worker._admit = _release, _admit

    w = WorkerThread(cfg, before=spy)
    wait_for(lambda: len(trajectories(cfg, 0, 0)) >= 8 * n, 300, lambda: engine_state(w), worker=w)
    w.join()
    assert len({t["trajectory_id"] for t in trajectories(cfg, 8 * n)}) == 8 * n
    assert limit <= max(queued) <= limit + n * (parts - 1), queued  # used, and bounded
    assert sorted(g for g, _ in admitted) == list(range(8))
    assert all(g < min(heads, default=g + 1) for g, heads in admitted), admitted
    ends = end_offsets(cfg, cfg.topics.name("prompts"))
    assert all(committed(cfg)[p] == hi for p, hi in ends.items() if hi > 0)


def test_a_duplicated_prompt_message_is_generated_twice_without_crashing_the_worker(make_config):
    """A prompt message published twice (the same group, e.g. by two feeds of one job run at once)
    has the same trajectory ids as its copy: both copies in flight at once once gave two engine
    requests one id, and the second output a ``KeyError`` that crash-looped the worker on every
    restart (the copies stay uncommitted). Both are generated (the trainer drops the repeated
    trajectory ids) and every offset is committed."""
    n = 4
    cfg = make_config("rl.group_size=4", "rl.max_staleness=100", "rollout.max_inflight=8", "rollout.max_new_tokens=6")
    topic = cfg.topics.name("prompts")
    dup = {"prompt_id": "rev-59", "group_id": "rev-59@e20", "group_seq": 0, "task": "copy", "text": "hi",
           "group_size": n, "sample_count": n, "created_at_ms": 1}  # fmt: skip
    with Producer(client_conf(cfg, "test", kind="producer")) as p:
        for _ in range(2):
            p.produce(topic, codec.encode("Prompt", dup), key=b"rev-59@e20", partition=1)
    w = WorkerThread(cfg)
    wait_for(lambda: len(trajectories(cfg, 0, 0)) >= 2 * n, 300, lambda: engine_state(w), worker=w)
    wait_for(lambda: committed(cfg).get(1) == 2, 120, "the two offsets committed", worker=w)
    w.join()
    got = sorted(t["trajectory_id"] for t in trajectories(cfg, 2 * n))
    assert got == sorted(f"rev-59@e20/{i}" for i in range(n) for _ in range(2))
    assert w.worker.stats["trajectories"] == 2 * n


@pytest.mark.parametrize("extra", [0, 2])
def test_an_over_provisioned_group_publishes_its_first_finishers_and_aborts_the_rest(make_config, extra):
    """rollout.overprovision: each group is drawn with ``extra`` more samples than rl.group_size;
    the first group_size to finish are published, numbered 0.. in finishing order, and the others
    are aborted. The sim engine's lengths are fixed by each draw's id, and every draw of a group
    starts together (slots for all), so the published lengths are the group's shortest draws.
    ``extra`` = 0 is the default rule: every draw is published."""
    from libs.engines.sim import sample_length
    from producers.config import SimEngineConfig

    n, groups, clip = 4, 6, 40
    engine = {"type": "sim", "token_latency_s": 0.01, "median_tokens": 10, "sigma": 0.8, "seed": 3}
    cfg = make_config(
        f"feed.source={DATA}", f"feed.limit={groups}", f"rl.group_size={n}", "rl.max_staleness=100",
        f"rollout.max_inflight={(n + extra) * groups}", f"rollout.max_new_tokens={clip}",
        f"rollout.overprovision={extra}", "rollout.metrics_interval_s=0.3", "rollout.exit_when_idle_s=3",
        "rollout.engine={" + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in engine.items()) + "}",
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg, timeout=600)
    got = trajectories(cfg, n * groups)
    assert len(got) == n * groups == len({t["trajectory_id"] for t in got})
    eng = SimEngineConfig(**{k: v for k, v in engine.items() if k != "type"})
    picked_long = 0
    for gid in {t["group_id"] for t in got}:
        mine = [t for t in got if t["group_id"] == gid]
        assert sorted(t["sample_index"] for t in mine) == list(range(n))
        drawn = [sample_length(eng, f"{gid}/{i}", clip) for i in range(n + extra)]
        kept = sorted(len(codec.unpack_i32(t["response_tokens"])) for t in mine)
        assert kept == sorted(drawn)[:n], (gid, drawn, kept)
        if extra:
            draws = sorted(int(t["metadata"]["drawn_as"]) for t in mine)
            assert len(set(draws)) == n and all(0 <= d < n + extra for d in draws)
            picked_long += any(d >= n for d in draws)
        else:
            assert "drawn_as" not in mine[0]["metadata"]
    if extra:
        assert picked_long, "no group kept an extra draw"  # the seed makes some of them short
    ends = {p: end for p, end in end_offsets(cfg, cfg.topics.name("prompts")).items() if end}
    assert {p: off for p, off in committed(cfg).items() if p in ends} == ends  # every message committed
    last = [r["metrics"] for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "rollout"][-1]
    assert last.get("overprovision_aborted_samples", 0) == extra * groups


def test_an_over_provisioned_group_with_a_trained_tail_publishes_every_draw_in_finishing_order(make_config):
    """rollout.overprovision_tail = "train": nothing is aborted; every draw is published in a group
    of group_size + extra with a quorum of group_size, numbered in finishing order (the first
    group_size are the group's shortest draws, the rest its tail), and the prompt message is
    committed once all of them are acknowledged."""
    from libs.engines.sim import sample_length
    from producers.config import SimEngineConfig

    n, extra, groups, clip = 4, 2, 5, 40
    engine = {"type": "sim", "token_latency_s": 0.01, "median_tokens": 10, "sigma": 0.8, "seed": 3}
    cfg = make_config(
        f"feed.source={DATA}", f"feed.limit={groups}", f"rl.group_size={n}", "rl.max_staleness=100",
        f"rollout.max_inflight={(n + extra) * groups}", f"rollout.max_new_tokens={clip}",
        f"rollout.overprovision={extra}", "rollout.overprovision_tail=train", "rollout.metrics_interval_s=0.3",
        "rollout.exit_when_idle_s=3",
        "rollout.engine={" + ", ".join(f"{k} = {v!r}".replace("'", '"') for k, v in engine.items()) + "}",
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg, timeout=600)
    got = trajectories(cfg, (n + extra) * groups)
    assert len(got) == (n + extra) * groups == len({t["trajectory_id"] for t in got})
    eng = SimEngineConfig(**{k: v for k, v in engine.items() if k != "type"})
    for gid in {t["group_id"] for t in got}:
        mine = sorted((t for t in got if t["group_id"] == gid), key=lambda t: t["sample_index"])
        assert [t["sample_index"] for t in mine] == list(range(n + extra))
        assert {(t["group_size"], t["metadata"]["quorum"]) for t in mine} == {(n + extra, str(n))}
        drawn = sorted(sample_length(eng, f"{gid}/{i}", clip) for i in range(n + extra))
        lengths = [len(codec.unpack_i32(t["response_tokens"])) for t in mine]
        assert sorted(lengths[:n]) == drawn[:n] and sorted(lengths[n:]) == drawn[n:], (gid, drawn, lengths)
        assert sorted(int(t["metadata"]["drawn_as"]) for t in mine) == list(range(n + extra))
    ends = {p: end for p, end in end_offsets(cfg, cfg.topics.name("prompts")).items() if end}
    assert {p: off for p, off in committed(cfg).items() if p in ends} == ends
    last = [r["metrics"] for _, r in read_topic(cfg, "metrics", "MetricEvent") if r["role"] == "rollout"][-1]
    assert last.get("overprovision_aborted_samples", 0) == 0
