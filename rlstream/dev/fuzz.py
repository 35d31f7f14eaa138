"""Bad records for a fault run (``rlstream chaos``): what a buggy or hostile producer could write to
rl.prompts, rl.rollouts and rl.scored, and a plain producer that injects them and notes where each
one landed (topic, partition, offset, from its delivery report), so the audit can look for each in
rl.dlq.

Kinds (``KINDS``, per topic):
* ``random_bytes``: random bytes (sometimes behind the Avro magic, sometimes empty or null);
* ``truncated``: a valid record of the topic's schema cut short;
* ``wrong_schema``: a valid record of another schema;
* valid schema, absurd values, each record wrong in one way only: token ids outside the
  vocabulary or negative, NaN/inf logprobs or rewards, a hugely negative ``group_seq``,
  ``max_new_tokens <= 0``, empty prompt text, ``version_max < version_min``, empty token arrays,
  multi-MB strings, ``group_size = 0``.

Every record names its own group (``fuzz-<n>``), so a bad record that is wrongly accepted shows up
as a ``fuzz-`` group in the trainer's steps log instead of corrupting a real group.

What this is not: a property-based fuzzer of the codec (tests/test_codec.py covers decoding).
"""

from __future__ import annotations

import json
import logging
import math
import random

import schemas
from pipeline import codec
from pipeline.control import now_ms
from pipeline.errors import DeliveryError
from pipeline.kafka import Producer, client_conf
from pipeline.log import kv

log = logging.getLogger(__name__)
HUGE_CHARS = 2_500_000
"""A multi-MB string (over the rollout worker's 1 Mi-character prompt limit)."""
ABSURD = {
    "token_out_of_vocab": ("rollouts", "scored"),
    "token_negative": ("rollouts", "scored"),
    "logprob_nan": ("rollouts", "scored"),
    "logprob_inf": ("rollouts", "scored"),
    "reward_nan": ("scored",),
    "reward_inf": ("scored",),
    "version_inverted": ("rollouts", "scored"),
    "empty_tokens": ("rollouts", "scored"),
    "group_seq_negative": ("prompts", "rollouts", "scored"),
    "group_size_zero": ("prompts", "rollouts", "scored"),
    "huge_text": ("prompts", "rollouts", "scored"),
    "empty_text": ("prompts",),
    "max_new_tokens_nonpositive": ("prompts",),
}
KINDS = {
    t: ["random_bytes", "truncated", "wrong_schema", *(k for k, ts in ABSURD.items() if t in ts)]
    for t in ("prompts", "rollouts", "scored")
}
SCHEMA_OF = {"prompts": "Prompt", "rollouts": "Trajectory", "scored": "ScoredTrajectory"}
WRONG = {"prompts": "Trajectory", "rollouts": "Prompt", "scored": "Trajectory"}


class RecordBuilder:
    """Valid base records of the run's task, and their bad variants."""

    def __init__(self, task: str, vocab_size: int, rng: random.Random):
        self.task, self.vocab, self.rng = task, vocab_size, rng

    def prompt(self, n: int) -> dict:
        d = self.rng.randrange(10)
        return {
            "prompt_id": f"fuzz-{n}",
            "group_id": f"fuzz-{n}@e0",
            "group_seq": -1,
            "task": self.task,
            "text": f"{d}>",
            "group_size": 8,
            "sample_start": 0,
            "sample_count": 8,
            "reference": json.dumps({"answer": str((d + 1) % 10)}),
            "epoch": 0,
            "max_new_tokens": None,
            "created_at_ms": now_ms(),
            "metadata": {"feed": "chaos-fuzz"},
        }

    def trajectory(self, n: int) -> dict:
        r = self.rng
        n_prompt, n_resp = r.randint(2, 6), r.randint(1, 4)
        return {
            "trajectory_id": f"fuzz-{n}/0",
            "group_id": f"fuzz-{n}",
            "group_seq": -1,
            "prompt_id": f"fuzz-{n}",
            "sample_index": 0,
            "group_size": 8,
            "task": self.task,
            "prompt_text": "3>",
            "response_text": "4",
            "prompt_tokens": codec.pack_i32([r.randrange(4, self.vocab) for _ in range(n_prompt)]),
            "response_tokens": codec.pack_i32([r.randrange(4, self.vocab) for _ in range(n_resp)]),
            "logprobs": codec.pack_f32([-r.uniform(0.5, 5.0) for _ in range(n_resp)]),
            "loss_mask": b"",
            "finish_reason": "stop",
            "version_min": 0,
            "version_max": 0,
            "reference": json.dumps({"answer": "4"}),
            "worker_id": "chaos-fuzz",
            "metadata": {"fuzz": "1"},
        }

    def scored(self, n: int) -> dict:
        return {
            "trajectory": self.trajectory(n),
            "reward": 1.0,
            "scorer_id": "chaos-fuzz",
            "scored_at_ms": now_ms(),
            "source_partition": -1,
            "source_offset": -1,
        }

    def valid(self, topic: str, n: int) -> dict:
        return {"prompts": self.prompt, "rollouts": self.trajectory, "scored": self.scored}[topic](n)

    def value(self, topic: str, kind: str, n: int) -> tuple[bytes | None, str | None]:
        """The bytes of bad record ``n`` of ``kind`` for ``topic``, and its schema label (None: not Avro)."""
        r = self.rng
        if kind == "random_bytes":
            roll = r.random()
            if roll < 0.05:
                return None, None
            body = r.randbytes(r.randint(0, 400))
            if roll < 0.35:  # past the magic check, into the fingerprint lookup and the body decoder
                body = codec.MAGIC + r.choice([r.randbytes(8), schemas.latest(SCHEMA_OF[topic]).fingerprint]) + body
            return body, None
        if kind == "truncated":
            full = codec.encode(SCHEMA_OF[topic], self.valid(topic, n))
            return full[: r.randint(1, len(full) - 1)], None
        if kind == "wrong_schema":
            name = WRONG[topic]
            rec = self.prompt(n) if name == "Prompt" else self.trajectory(n)
            return codec.encode(name, rec), schemas.latest(name).label
        rec = self.valid(topic, n)
        absurd(kind, rec, self.vocab, r)
        name = SCHEMA_OF[topic]
        return codec.encode(name, rec), schemas.latest(name).label


def absurd(kind: str, rec: dict, vocab: int, rng: random.Random) -> None:
    """Make ``rec`` (a Prompt, Trajectory or ScoredTrajectory) wrong in exactly one way, in place."""
    t = rec.get("trajectory", rec)
    if kind in ("token_out_of_vocab", "token_negative"):
        toks = list(codec.unpack_i32(t["response_tokens"]))
        toks[rng.randrange(len(toks))] = vocab + rng.randint(0, 10**6) if kind == "token_out_of_vocab" else -1
        t["response_tokens"] = codec.pack_i32(toks)
    elif kind in ("logprob_nan", "logprob_inf"):
        lps = list(codec.unpack_f32(t["logprobs"]))
        lps[rng.randrange(len(lps))] = math.nan if kind == "logprob_nan" else rng.choice([math.inf, -math.inf])
        t["logprobs"] = codec.pack_f32(lps)
    elif kind in ("reward_nan", "reward_inf"):
        rec["reward"] = math.nan if kind == "reward_nan" else rng.choice([math.inf, -math.inf])
    elif kind == "version_inverted":
        t["version_min"], t["version_max"] = 2, 1
    elif kind == "empty_tokens":
        t["prompt_tokens"] = t["response_tokens"] = t["logprobs"] = b""
    elif kind == "group_seq_negative":
        t["group_seq"] = -(10**15) - rng.randint(0, 10**6)
    elif kind == "group_size_zero":
        t["group_size"] = 0
        if "sample_count" in t:
            t["sample_count"] = 0
    elif kind == "huge_text":
        t["text" if "text" in t else "response_text"] = "7" * HUGE_CHARS
    elif kind == "empty_text":
        t["text"] = ""
    elif kind == "max_new_tokens_nonpositive":
        t["max_new_tokens"] = rng.choice([0, -1, -(2**31)])
    else:
        raise ValueError(f"unknown fuzz kind {kind!r}")


def schedule(total: int, rng: random.Random, huge_max: int) -> list[tuple[str, str]]:
    """``total`` (topic, kind) pairs: every pair once (when ``total`` allows), then random ones;
    at most ``huge_max`` multi-MB records."""
    pairs = [(t, k) for t, ks in KINDS.items() for k in ks]
    rng.shuffle(pairs)
    out = pairs[:total]
    while len(out) < total:
        t = rng.choice(list(KINDS))
        out.append((t, rng.choice(KINDS[t])))
    huge = [i for i, (_, k) in enumerate(out) if k == "huge_text"]
    for i in huge[huge_max:]:
        out[i] = (out[i][0], "random_bytes")
    return out


class Injector:
    """Produces the scheduled bad records with a plain rlstream Producer; ``records`` holds each one's
    topic, kind and (once acknowledged) partition and offset."""

    def __init__(self, cfg, total: int, rng: random.Random, vocab_size: int, task: str):
        self.cfg, self.rng = cfg, rng
        self.builder = RecordBuilder(task, vocab_size, rng)
        self.plan = schedule(total, rng, max(3, total // 100))
        self.records: list[dict] = []
        # librdkafka's own log would repeat every failed reconnect while the broker restarts
        self.producer = Producer({**client_conf(cfg, "chaos-fuzz", kind="producer"), "log_level": 2})
        self.partitions = {t: getattr(cfg.topics, t).partitions for t in KINDS}

    @property
    def remaining(self) -> int:
        return len(self.plan) - len(self.records)

    def inject(self, n: int) -> int:
        """Produce the next ``n`` scheduled records (without waiting for them); returns how many."""
        todo = self.plan[len(self.records) : len(self.records) + n]
        for topic, kind in todo:
            i = len(self.records)
            value, label = self.builder.value(topic, kind, i)
            key = None if kind == "random_bytes" and self.rng.random() < 0.5 else f"fuzz-{i}".encode()
            rec = {"topic": topic, "kind": kind, "n": i, "bytes": len(value or b""), "partition": None, "offset": None}
            self.records.append(rec)
            kw = {
                "key": key,
                "headers": {codec.SCHEMA_HEADER: label.encode()} if label else None,
                "partition": self.rng.randrange(self.partitions[topic]),
                "on_delivery": self._acked(rec),
            }
            try:
                self.producer.produce(self.cfg.topics.name(topic), value, **kw)
            except DeliveryError as exc:  # an earlier record's failure (noted on it): send this one anyway
                log.warning("fuzz delivery failed %s", kv(error=exc))
                self.producer.produce(self.cfg.topics.name(topic), value, **kw)
        self.poll()
        return len(todo)

    @staticmethod
    def _acked(rec: dict):
        def cb(err, msg):
            if err is None:
                rec["partition"], rec["offset"] = msg.partition(), msg.offset()
            else:
                rec["error"] = str(err)

        return cb

    def poll(self) -> None:
        try:
            self.producer.poll(0)
        except DeliveryError as exc:  # a failed delivery is recorded on its record; keep injecting
            log.warning("fuzz delivery failed %s", kv(error=exc))

    def flush(self, timeout: float) -> None:
        """Wait for every delivery report (riding out a broker restart)."""
        try:
            self.producer.flush_patiently(timeout, "fuzz records")
        except DeliveryError as exc:  # reported per record (no offset): the audit counts it
            log.warning("fuzz flush failed %s", kv(error=exc))

    def delivered(self) -> list[dict]:
        return [r for r in self.records if r["offset"] is not None]

    def close(self) -> None:
        self.producer.abandon()
