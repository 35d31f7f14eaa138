"""Helpers for tests, benchmarks and demos of the rollout side: read a topic to its end, publish a
weights version, and build weights that force the model to emit one token.

What this is not: part of any worker's data path.
"""

from __future__ import annotations

import time

from confluent_kafka import TopicPartition

from pipeline.checkpoint import write_weights
from pipeline.control import now_ms, publish_weight_update
from pipeline.kafka import Consumer, Producer, client_conf, decode_message
from producers.feed import watermarks


def end_offsets(cfg, topic: str) -> dict[int, int]:
    c = Consumer(client_conf(cfg, "test", kind="consumer"))
    try:
        meta = c.client.list_topics(topic, timeout=10).topics[topic]
        return {p: watermarks(c, topic, p)[1] for p in meta.partitions}
    finally:
        c.close()


def read_topic(cfg, role: str, schema: str | None = None, min_count: int = 0, timeout: float = 60.0) -> list:
    """Messages of ``cfg.topics.name(role)`` from the start to the end (waiting up to ``timeout``
    for at least ``min_count``). With ``schema``, returns ``(message, record)`` pairs."""
    topic = cfg.topics.name(role)
    deadline = time.monotonic() + timeout
    while True:
        ends = end_offsets(cfg, topic)
        if sum(ends.values()) >= min_count or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    c = Consumer(client_conf(cfg, "test", kind="consumer"))
    out = []
    try:
        todo = {p: hi for p, hi in ends.items() if hi > 0}
        c.assign([TopicPartition(topic, p, 0) for p in todo])
        while todo and time.monotonic() < deadline + 30:
            for m in c.consume(1000, 0.5):
                out.append(m)
                if m.offset() + 1 >= todo.get(m.partition(), 0):
                    todo.pop(m.partition(), None)
    finally:
        c.close()
    if schema:
        return [(m, decode_message(m, schema)) for m in out]
    return out


def forcing_state_dict(base: dict, token_id: int, strength: float = 10.0) -> dict:
    """Weights of a Llama-style model that emits ``token_id`` after any context: every token embeds
    to e0, the residual branches are zeroed, and only ``token_id``'s lm_head row reads e0."""
    sd = {k: v.clone() for k, v in base.items()}
    for k, v in sd.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            v.zero_()
    emb = sd["model.embed_tokens.weight"]
    emb.zero_()
    emb[:, 0] = 1.0
    head = sd["lm_head.weight"]
    head.zero_()
    head[token_id, 0] = strength
    return sd


def publish_version(cfg, version: int, state_dict, producer: Producer | None = None) -> dict:
    """Write ``state_dict`` as weights ``version`` to the store, then announce it on rl.control."""
    uri, sha, nbytes = write_weights(cfg.store, version, state_dict)
    update = {
        "version": version,
        "uri": uri,
        "sha256": sha,
        "bytes": nbytes,
        "step": version,
        "created_at_ms": now_ms(),
        "trainer_id": "test",
    }
    p = producer or Producer(client_conf(cfg, "test", kind="producer"))
    publish_weight_update(p, cfg.topics.name("control"), update)
    if producer is None:
        p.close()
    return update
