"""The prompt feed: group numbering across epochs, replication, exact resume (also after kill -9),
dataset formats and errors."""

import collections
import json
import os
import signal
import subprocess
import time

import pytest

from libs.datasets import load_dataset
from pipeline.errors import ConfigError
from producers import feed
from producers.feed import split_group
from tests.conftest import rlstream_cmd, run_cli
from tests.rollout_helpers import end_offsets, read_topic

DATA = "tests/data/prompts.jsonl"
N = 12  # records in DATA


def prompts(cfg, n=0):
    return [r for _, r in read_topic(cfg, "prompts", "Prompt", n, 30)]


def test_split_group():
    assert split_group(4, 1) == [(0, 4)]
    assert split_group(5, 2) == [(0, 3), (3, 2)]
    assert split_group(2, 8) == [(0, 1), (1, 1)]


@pytest.mark.kafka
def test_epochs_number_groups_globally(make_config):
    cfg = make_config(f"feed.source={DATA}", "feed.epochs=2", "rl.group_size=3")
    stats = feed.run(cfg)
    assert stats == {**stats, "groups": 24, "messages": 24, "next_group_seq": 24}
    got = sorted(prompts(cfg, 24), key=lambda r: r["group_seq"])
    assert [r["group_seq"] for r in got] == list(range(24))
    records = [json.loads(line) for line in open(DATA)]
    for r in got:
        e, i = divmod(r["group_seq"], N)
        src = records[i]
        assert r["epoch"] == e and r["group_id"] == f"{src['id']}@e{e}" and r["prompt_id"] == src["id"]
        assert (r["group_size"], r["sample_start"], r["sample_count"]) == (3, 0, 3)
        assert r["task"] == "copy" and json.loads(r["reference"]) == src["reference"] and r["text"] == src["prompt"]
        assert r["metadata"]["feed"] == "default"


@pytest.mark.kafka
def test_replicate_spreads_a_group_over_partitions(make_config):
    cfg = make_config(f"feed.source={DATA}", "rl.replicate=3", "rl.group_size=4", "feed.limit=6")
    feed.run(cfg)
    msgs = read_topic(cfg, "prompts", "Prompt", 18)
    groups = collections.defaultdict(list)
    for m, r in msgs:
        assert m.key() == r["group_id"].encode()
        groups[r["group_id"]].append((r["sample_start"], r["sample_count"], m.partition()))
    assert len(groups) == 6
    for parts in groups.values():
        assert sorted((s, c) for s, c, _ in parts) == [(0, 2), (2, 1), (3, 1)]
        assert len({p for *_, p in parts}) == 3  # distinct partitions, so different workers


@pytest.mark.kafka
def test_resume_never_resends(make_config):
    cfg = make_config(f"feed.source={DATA}", "feed.limit=5", "feed.checkpoint_every=2")
    assert feed.run(cfg)["messages"] == 5
    assert feed.run(cfg)["messages"] == 0  # the limit is a total: a restart with it feeds no more
    cfg.feed.limit = 7  # raised: continues up to it
    s2 = feed.run(cfg)
    assert (s2["start_group_seq"], s2["messages"]) == (5, 2)
    cfg.feed.limit = 0
    s2 = feed.run(cfg)
    assert (s2["start_group_seq"], s2["messages"]) == (7, 5)
    assert feed.run(cfg)["messages"] == 0  # all fed: nothing to do
    cfg.feed.epochs = 2  # more epochs later: continues with group_seq 12
    assert feed.run(cfg)["start_group_seq"] == 12
    seqs = collections.Counter(r["group_seq"] for r in prompts(cfg, 24))
    assert sorted(seqs) == list(range(24)) and set(seqs.values()) == {1}


@pytest.mark.kafka
def test_resume_after_kill_9_is_exact(make_config, cli_env, tmp_path):
    cfg = make_config()
    env = {**cli_env, "RLSTREAM_FEED__CHECKPOINT_EVERY": "4", "RLSTREAM_FEED__REPLICATE": "2"}
    args = ["feed", os.path.abspath(DATA), "--epochs", "2", "--rate", "5"]
    proc = subprocess.Popen([*rlstream_cmd(), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    topic = cfg.topics.name("prompts")
    deadline = time.monotonic() + 60
    while sum(end_offsets(cfg, topic).values()) < 14 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    before = sum(end_offsets(cfg, topic).values())
    assert 14 <= before < 48, "the feed was not killed mid-way"
    out = run_cli(["feed", os.path.abspath(DATA), "--epochs", "2"], env)
    stats = json.loads(out.stdout.strip().splitlines()[-1])
    assert stats["messages"] == 48 - before  # exactly the missing ones
    got = collections.Counter((r["group_seq"], r["sample_start"]) for r in prompts(cfg, 48))
    assert len(got) == 48 and set(got.values()) == {1}  # every message once: none lost, none re-sent


@pytest.mark.kafka
def test_changed_dataset_is_refused(make_config, tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n')
    cfg = make_config(f"feed.source={src}")
    feed.run(cfg)
    src.write_text('{"id": "a", "prompt": "y"}\n')
    with pytest.raises(ConfigError, match="dataset changed"):
        feed.run(cfg)


def test_dataset_normalization_and_errors(tmp_path, make_config_offline):
    src = tmp_path / "d.jsonl"
    src.write_text(
        '{"prompt_id": 7, "text": "hi", "answer": 3, "n": 2, "max_new_tokens": 9}\n\n{"prompt": "yo", "task": "t"}\n'
    )
    fc = make_config_offline(f"feed.source={src}").feed
    a, b = load_dataset(fc)
    assert (a["prompt_id"], a["text"], a["task"], a["n"], a["max_new_tokens"]) == ("7", "hi", "default", 2, 9)
    assert json.loads(a["reference"]) == {"answer": 3}
    assert (b["prompt_id"], b["task"], b["n"], json.loads(b["reference"])) == ("1", "t", None, {})
    src.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(ConfigError, match=r"d.jsonl:2: not valid JSON"):
        load_dataset(fc)
    src.write_text('{"prompt": "ok", "n": 0}\n')
    with pytest.raises(ConfigError, match="n must be a positive integer"):
        load_dataset(fc)


def test_parquet_source(tmp_path, make_config_offline):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["x", "y"], "reference": ['{"k": 1}', "z"]}), path)
    recs = load_dataset(make_config_offline(f"feed.source={path}").feed)
    assert [r["prompt_id"] for r in recs] == ["a", "b"] and json.loads(recs[1]["reference"]) == "z"


@pytest.fixture
def make_config_offline(tmp_path):
    from rlstream.config import load_config

    return lambda *o: load_config(None, [f"run_dir={tmp_path}", *o], environ={})


@pytest.mark.kafka
def test_paced_dispatch_admits_and_places_on_the_shortest_queue(make_config):
    """feed.dispatch = paced: nothing inadmissible is published (k = 0, G = 2: groups 0 and 1 at
    version 0), no partition holds more than paced_backlog uncommitted messages, and a commit by the
    rollout group (a worker finishing) or a newer version lets the next groups out, onto the
    partitions that are free."""
    import threading

    from pipeline.kafka import Consumer, TopicPartition, client_conf
    from tests.rollout_helpers import publish_version
    from tests.test_rollout import base_state

    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=8", "rl.group_size=2", "rl.groups_per_step=2", "rl.max_staleness=0",
        "topics.prompts.partitions=3", 'feed.dispatch="paced"', "feed.paced_backlog=1", "feed.paced_lead_steps=0",
    )  # fmt: skip
    f = feed.Feed(cfg)
    t = threading.Thread(target=f.run, daemon=True)
    t.start()

    def settle(n: int) -> list:
        deadline = time.monotonic() + 60
        while len(prompts(cfg)) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # and nothing more comes out
        return prompts(cfg)

    try:
        first = settle(2)
        assert sorted(r["group_seq"] for r in first) == [0, 1]  # admission: v0 admits groups 0 and 1 only
        for v in (1, 2, 3):  # versions follow each other (a gap is an implausible notice)
            publish_version(cfg, v, base_state(cfg))  # v3 admits every group; the queues now limit
        second = settle(3)
        assert sorted(r["group_seq"] for r in second) == [0, 1, 2]  # 3 partitions, backlog 1 each
        ends = end_offsets(cfg, cfg.topics.name("prompts"))
        assert sorted(ends.values()) == [1, 1, 1]  # one message on each partition: the shortest queues
        with Consumer(client_conf(cfg, "test", kind="consumer"), group_id=cfg.rollout.group_id) as c:
            busy = [p for p, hi in ends.items() if hi][:2]  # "workers" finish two of them
            c.commit([TopicPartition(cfg.topics.name("prompts"), p, 1) for p in busy])
        third = settle(5)
        assert sorted(r["group_seq"] for r in third) == [0, 1, 2, 3, 4]
        assert sorted(end_offsets(cfg, cfg.topics.name("prompts")).values()) == [1, 2, 2]
    finally:
        f.stop()
        t.join(60)
    assert not t.is_alive()


@pytest.mark.kafka
def test_paced_dispatch_publishes_lead_steps_ahead_of_admission(make_config):
    """feed.paced_lead_steps = 1 (k = 0, G = 2): at version 0 groups 0-3 go out (admission allows 0
    and 1, plus one step of lead) and nothing more; version 1 lets out exactly the next step's."""
    import threading

    from tests.rollout_helpers import publish_version
    from tests.test_rollout import base_state

    cfg = make_config(
        f"feed.source={DATA}", "feed.limit=10", "rl.group_size=2", "rl.groups_per_step=2", "rl.max_staleness=0",
        'feed.dispatch="paced"', "feed.paced_backlog=100", "feed.paced_lead_steps=1",
    )  # fmt: skip
    f = feed.Feed(cfg)
    t = threading.Thread(target=f.run, daemon=True)
    t.start()

    def settle(n: int) -> list[int]:
        deadline = time.monotonic() + 60
        while len(prompts(cfg)) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # and nothing more comes out
        return sorted(r["group_seq"] for r in prompts(cfg))

    try:
        assert settle(4) == [0, 1, 2, 3]
        publish_version(cfg, 1, base_state(cfg))
        assert settle(6) == [0, 1, 2, 3, 4, 5]
    finally:
        f.stop()
        t.join(60)
    assert not t.is_alive()
