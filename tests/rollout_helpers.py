"""Test helpers of the rollout side (not shipped in the package): read a topic to its end, publish a
weights version, and build weights that force the model to emit one token.

What this is not: part of any worker's data path.
"""

from __future__ import annotations

import time

from pipeline.checkpoint import write_weights
from pipeline.control import now_ms, publish_weight_update
from pipeline.kafka import Consumer, Producer, client_conf, decode_message


def end_offsets(cfg, topic: str) -> dict[int, int]:
    with Consumer(client_conf(cfg, "test", kind="consumer")) as c:
        return {p: c.watermarks(topic, p)[1] for p in c.partitions(topic, 10)}


def read_topic(cfg, role: str, schema: str | None = None, min_count: int = 0, timeout: float = 60.0) -> list:
    """Messages of ``cfg.topics.name(role)`` from the start to the end (waiting up to ``timeout``
    for at least ``min_count``). With ``schema``, returns ``(message, record)`` pairs."""
    topic = cfg.topics.name(role)
    deadline = time.monotonic() + timeout
    while sum(end_offsets(cfg, topic).values()) < min_count and time.monotonic() < deadline:
        time.sleep(0.2)
    with Consumer(client_conf(cfg, "test", kind="consumer")) as c:
        out = c.read_to_end(topic, timeout=max(30.0, deadline - time.monotonic()))
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
