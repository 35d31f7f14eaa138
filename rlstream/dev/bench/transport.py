"""Benchmark 2, transport overhead: how fast trajectories move through rlstream's Kafka path, next
to raw confluent-kafka moving the same bytes on the same broker in the same run.

Stages, each timed on its own so one does not hide behind another:

1. **produce**: N trajectories (``response_tokens`` tokens each, groups of n) written to rl.rollouts
   with rlstream's Producer (Avro encode, idempotent, acks=all), in this process.
2. **reward**: one ``rlstream reward`` worker with the trivial ``exact_match`` reward scores them all
   into rl.scored (consume, decode, score, produce in a transaction, send offsets, commit). Rate from
   the broker timestamps of the first and last scored record, so start-up is not counted.
3. **trainer**: ``rlstream train`` with the ``sim`` engine at zero cost (a no-op optimizer) reads
   rl.scored (read_committed), assembles groups, applies the staleness gate and collates micro-batches.
   Rate over its steps 2..S from its steps log.

Raw references: ``bench.raw_kafka.measure_throughput`` (produce, then consume, of N messages of the
mean trajectory size) and a raw pass-through (consume a message, produce it to another topic: the
reward stage's data movement without Avro, scoring or transactions). It prints figures; it asserts
nothing.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from confluent_kafka import Consumer as RawConsumer
from confluent_kafka import Producer as RawProducer
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from pipeline.kafka.consumer import FETCH_QUEUE_BACKOFF_MS
from rlstream.dev.bench.harness import (
    BenchContext,
    log_line,
    make_config,
    md_table,
    pyplot,
    read_topic,
    rnd,
    run_pipeline,
    summarize_profile,
    write_json,
)
from rlstream.dev.bench.raw_kafka import measure_throughput

SIZES = {
    "tiny": {"trajectories": 256, "response_tokens": 128, "prompt_tokens": 32, "trainer_steps": 4, "raw_factor": 1},
    "full": {
        "trajectories": 8192,
        "response_tokens": 1024,
        "prompt_tokens": 128,
        "trainer_steps": 128,
        "raw_factor": 3,
    },
}
GROUP_SIZE, GROUPS_PER_STEP = 8, 8


def trajectories(n: int, prompt_tokens: int, response_tokens: int, seed: int = 0):
    """``n`` Trajectory records in complete groups of GROUP_SIZE (group_seq 0, 1, ...)."""
    from pipeline import codec

    rng = random.Random(seed)
    pool = [
        (
            codec.pack_i32([rng.randrange(4, 100) for _ in range(prompt_tokens)]),
            codec.pack_i32([rng.randrange(4, 100) for _ in range(response_tokens)]),
            codec.pack_f32([-rng.random() * 5 for _ in range(response_tokens)]),
            "".join(rng.choice("abcdefghij ") for _ in range(response_tokens)),
        )
        for _ in range(8)
    ]
    for i in range(n):
        g, j = divmod(i, GROUP_SIZE)
        prompt, resp, lps, text = pool[i % len(pool)]
        yield {
            "trajectory_id": f"g{g}/{j}",
            "group_id": f"g{g}",
            "group_seq": g,
            "prompt_id": f"p{g}",
            "sample_index": j,
            "group_size": GROUP_SIZE,
            "task": "bench",
            "prompt_text": "q",
            "response_text": text,
            "prompt_tokens": prompt,
            "response_tokens": resp,
            "logprobs": lps,
            "loss_mask": b"",
            "finish_reason": "length",
            "version_min": 0,
            "version_max": 0,
            "reference": json.dumps({"answer": "x"}),
            "worker_id": "bench",
            "engine": "bench",
            "prompt_created_at_ms": 0,
            "gen_started_at_ms": 0,
            "gen_finished_at_ms": 0,
            "metadata": {},
        }


def produce_rollouts(cfg, recs) -> tuple[int, float, float]:
    """Produce with rlstream's Producer; returns (messages, bytes, seconds including the final flush)."""
    from pipeline import codec
    from pipeline.kafka import Producer, client_conf

    topic = cfg.topics.name("rollouts")
    recs = list(recs)
    nbytes = sum(len(codec.encode("Trajectory", r)) for r in recs[:64]) * len(recs) / min(64, len(recs))
    n = 0
    with Producer(client_conf(cfg, "bench", kind="producer")) as p:
        p.partitions(topic)  # connected before the clock starts
        t0 = time.perf_counter()
        for rec in recs:  # what a rollout worker does per trajectory: encode, produce with headers
            p.produce_record(topic, "Trajectory", rec, key=rec["group_id"].encode())
            n += 1
        p.flush(120)
        dt = time.perf_counter() - t0
    return n, nbytes, dt


def raw_passthrough(bootstrap: str, messages: int, size: int, partitions: int = 8) -> dict:
    """Raw confluent-kafka consume -> produce of ``messages`` messages of ``size`` bytes (idempotent
    producer, manual commits every 1000 messages): the reward stage's data movement, nothing else."""
    src, dst = (f"bench-pass-{os.getpid()}-{int(time.time() * 1000)}-{x}" for x in ("a", "b"))
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([NewTopic(t, partitions, 1) for t in (src, dst)]).values():
        f.result()
    pconf = {"bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
    p = RawProducer(pconf)
    payload = os.urandom(size)
    for i in range(messages):
        while True:
            try:
                p.produce(src, payload, key=str(i % 1000).encode())
                break
            except BufferError:
                p.poll(0.01)
    p.flush(120)
    c = RawConsumer({"bootstrap.servers": bootstrap, "group.id": src, "enable.auto.commit": False,
                     "auto.offset.reset": "earliest", "fetch.max.bytes": 64 << 20,
                     "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS})  # fmt: skip
    c.assign([TopicPartition(src, q, 0) for q in range(partitions)])
    got = 0
    t0 = deadline = time.perf_counter()
    while got < messages and time.perf_counter() - deadline < 300:
        for m in c.consume(1000, 1.0):
            if m.error() is None:
                if got == 0:
                    t0 = time.perf_counter()  # from the first message, as for the rlstream stages
                while True:
                    try:
                        p.produce(dst, m.value(), key=m.key())
                        break
                    except BufferError:
                        p.poll(0.01)
                got += 1
                if got % 1000 == 0:
                    c.commit(asynchronous=False)
        p.poll(0)
    p.flush(120)
    c.commit(asynchronous=False)
    dt = time.perf_counter() - t0
    c.close()
    for f in admin.delete_topics([src, dst]).values():
        f.result()
    return {"messages": got, "msgs_per_s": round(got / dt), "MB_per_s": round(got * size / 1e6 / dt, 1)}


def run(ctx: BenchContext) -> dict:
    sz = SIZES[ctx.size]
    n = sz["trajectories"] - sz["trajectories"] % (GROUP_SIZE * GROUPS_PER_STEP)
    steps = min(sz["trainer_steps"], n // (GROUP_SIZE * GROUPS_PER_STEP))
    cfg, path = make_config(
        ctx,
        "transport",
        {
            "rl.group_size": GROUP_SIZE,
            "rl.groups_per_step": GROUPS_PER_STEP,
            "rl.max_staleness": 1000,
            "topics.rollouts.partitions": 8,
            "topics.scored.partitions": 8,
            "reward.executor": "thread",
            "reward.pool_size": 1,
            "reward.max_batch_size": 512,
            "reward.max_batch_ms": 100,
            "reward.timeout_s": 1,
            "trainer.engine": {"type": "sim", "token_cost_s": 0.0},
            "trainer.max_steps": steps,
            "trainer.publish_every": 1000,
            "trainer.micro_batch_size": 64,
            "trainer.poll_timeout_s": 0.05,
            "trainer.group_timeout_s": 600,
            "model.hidden_size": 64,
            "model.intermediate_size": 128,
            "model.num_heads": 4,
            # the trainer refuses (dead-letters) samples longer than the model's context: room for them
            "model.max_position_embeddings": sz["prompt_tokens"] + sz["response_tokens"] + 64,
        },
    )
    from pipeline.admin import Admin, ensure_topics
    from pipeline.kafka import client_conf

    ensure_topics(cfg)
    m, nbytes, produce_s = produce_rollouts(cfg, trajectories(n, sz["prompt_tokens"], sz["response_tokens"]))
    mean_size = nbytes / m
    log_line(ctx, "transport: produced", trajectories=m, mean_bytes=round(mean_size), s=round(produce_s, 2))

    admin = Admin(client_conf(cfg, "bench"))

    def reward_done() -> bool:
        try:
            return sum(admin.lag(cfg.reward.group_id, cfg.topics.name("rollouts")).values()) == 0
        except Exception:  # the group may not exist yet
            return False

    r1 = run_pipeline(
        ctx, cfg, path, 0, 1, feed=False, trainer=False, timeout_s=600, done=reward_done, profile=["reward-0"]
    )
    scored = read_topic(cfg, "scored", "ScoredTrajectory")
    ts = sorted(t for t, *_ in scored)
    reward_s = (ts[-1] - ts[0]) / 1e3 if len(ts) > 1 else float("nan")
    r2 = run_pipeline(ctx, cfg, path, 0, 0, feed=False, trainer=True, timeout_s=600, profile=["trainer"])
    from consumers.trainer.state import read_steps_log

    log = read_steps_log(Path(cfg.run_dir) / "trainer")
    trained = sum(len(s["used"]) for s in log[1:])
    train_s = log[-1]["time"] - log[0]["time"] if len(log) > 1 else float("nan")
    raw = measure_throughput(ctx.bootstrap, m * sz["raw_factor"], round(mean_size), partitions=8)
    passthrough = raw_passthrough(ctx.bootstrap, m, round(mean_size))
    mb = mean_size / 1e6
    rl = {
        "produce_msgs_per_s": rnd(m / produce_s, 0),
        "produce_MB_per_s": rnd(m * mb / produce_s, 1),
        "reward_stage_msgs_per_s": rnd(len(ts) / reward_s if reward_s else None, 0),
        "reward_stage_MB_per_s": rnd(len(ts) * mb / reward_s if reward_s else None, 1),
        "trainer_msgs_per_s": rnd(trained / train_s if train_s else None, 0),
        "trainer_MB_per_s": rnd(trained * mb / train_s if train_s else None, 1),
        "scored_records": len(ts),
        "trainer_steps": len(log),
    }
    ratios = {
        "produce_vs_raw_produce": rnd(rl["produce_msgs_per_s"] / raw["produce_msgs_per_s"]),
        "reward_stage_vs_raw_passthrough": rnd((rl["reward_stage_msgs_per_s"] or 0) / passthrough["msgs_per_s"]),
        "trainer_vs_raw_consume": rnd((rl["trainer_msgs_per_s"] or 0) / raw["consume_msgs_per_s"]),
    }
    result = {
        "benchmark": "transport",
        "size": ctx.size,
        "trajectories": m,
        "mean_trajectory_bytes": round(mean_size),
        "response_tokens": sz["response_tokens"],
        "rlstream": rl,
        "raw": raw,
        "raw_passthrough": passthrough,
        "ratios": ratios,
        "status": {"reward": r1.status, "trainer": r2.status},
        "profiles": {n: summarize_profile(p) for n, p in {**r1.profiles, **r2.profiles}.items()},
        "loadavg": [r1.loadavg, r2.loadavg],
    }
    log_line(ctx, "transport", **ratios)
    write_json(ctx.out / "transport.json", result)
    result["plots"] = [str(p) for p in plot(ctx.out, result)]
    write_json(ctx.out / "transport.json", result)
    return result


def table(result: dict) -> str:
    rl, raw, pt, r = result["rlstream"], result["raw"], result["raw_passthrough"], result["ratios"]
    rows = [
        ["produce to rl.rollouts", rl["produce_msgs_per_s"], rl["produce_MB_per_s"], "raw produce",
         raw["produce_msgs_per_s"], raw["produce_MB_per_s"], r["produce_vs_raw_produce"]],
        ["reward stage (rollouts → scored, exactly-once)", rl["reward_stage_msgs_per_s"], rl["reward_stage_MB_per_s"],
         "raw consume → produce", pt["msgs_per_s"], pt["MB_per_s"], r["reward_stage_vs_raw_passthrough"]],
        ["no-op trainer (read_committed, assemble, collate)", rl["trainer_msgs_per_s"], rl["trainer_MB_per_s"],
         "raw consume", raw["consume_msgs_per_s"], raw["consume_MB_per_s"], r["trainer_vs_raw_consume"]],
    ]  # fmt: skip
    head = f"{result['trajectories']} trajectories of {result['mean_trajectory_bytes']:,} bytes ({result['response_tokens']} response tokens)\n\n"
    return head + md_table(["rlstream stage", "traj/s", "MB/s", "raw reference", "msgs/s", "MB/s", "ratio"], rows)


def plot(out: Path, result: dict) -> list[Path]:
    if (plt := pyplot()) is None:
        return []
    rl, raw, pt = result["rlstream"], result["raw"], result["raw_passthrough"]
    labels = ["produce", "reward stage\n(vs raw pass-through)", "trainer\n(vs raw consume)"]
    ours = [rl["produce_MB_per_s"] or 0, rl["reward_stage_MB_per_s"] or 0, rl["trainer_MB_per_s"] or 0]
    theirs = [raw["produce_MB_per_s"], pt["MB_per_s"], raw["consume_MB_per_s"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], ours, 0.4, label="rlstream", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="raw confluent-kafka", color="#999999")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("MB/s")
    ax.set_title(f"transport, {result['mean_trajectory_bytes']:,}-byte trajectories", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = out / "transport.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return [p]
