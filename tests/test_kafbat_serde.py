"""The Kafbat UI serde plugin (infra/kafbat-serde, Java): every rlstream record type, written by the
Python codec through a real broker, is decoded by the plugin's Serde (driven through DecodeMain, which
makes the same Serde API calls as Kafbat UI) into JSON equal to what the Python codec decodes.

The plugin is built by scripts/setup-infra-tools.sh (Maven); without the build, or without Java,
these tests skip and say so."""

from __future__ import annotations

import base64
import json
import math
import shutil
import struct
import subprocess
import time
import uuid

import pytest

from pipeline import codec
from tests.infra_tools import REPO, SETUP

TARGET = REPO / "infra/kafbat-serde/target"
CLASSPATH = f"{TARGET / 'plugin'}/*:{TARGET / 'cli-lib'}/*"
PACKED = {"prompt_tokens": "<i", "response_tokens": "<i", "logprobs": "<f", "loss_mask": "B"}

pytestmark = [
    pytest.mark.skipif(shutil.which("java") is None, reason="java not found"),
    pytest.mark.skipif(
        not list((TARGET / "plugin").glob("rlstream-kafbat-serde-*.jar")),
        reason=f"Kafbat serde plugin not built (run {SETUP})",
    ),
]


def decode_with_java(values: list[bytes], schemas=REPO / "schemas", topic: str = "rl.rollouts") -> list[dict]:
    stdin = "".join(base64.b64encode(v).decode() + "\n" for v in values)
    proc = subprocess.run(
        ["java", "-cp", CLASSPATH, "dev.rlstream.kafbat.DecodeMain", str(schemas), topic],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def as_json(value, field: str = ""):
    """What the plugin should show for a Python-decoded value (packed fields as arrays, bytes as base64)."""
    if isinstance(value, dict):
        return {k: as_json(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [as_json(v) for v in value]
    if isinstance(value, bytes):
        fmt = PACKED.get(field)
        if fmt and len(value) % struct.calcsize(fmt) == 0:
            return [as_json(x[0]) for x in struct.iter_unpack(fmt, value)]
        return base64.b64encode(value).decode()
    if isinstance(value, float) and not math.isfinite(value):
        return {math.inf: "Infinity", -math.inf: "-Infinity"}.get(value, "NaN")
    return value


def f32(obj):
    """Round every float to float32 (the plugin prints float32 logprobs in their shortest form)."""
    if isinstance(obj, dict):
        return {k: f32(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [f32(v) for v in obj]
    return struct.unpack("<f", struct.pack("<f", obj))[0] if isinstance(obj, float) else obj


def trajectory(i: int) -> dict:
    return {
        "trajectory_id": f"g{i}/1",
        "group_id": f"g{i}",
        "group_seq": 40 + i,
        "prompt_id": f"p{i}",
        "sample_index": 1,
        "group_size": 4,
        "task": "next_digit",
        "prompt_text": "7>",
        "response_text": "8 é",
        "prompt_tokens": codec.pack_i32([7, 12, -1, 2**31 - 1]),
        "response_tokens": codec.pack_i32([8, 0, 3]),
        "logprobs": codec.pack_f32([-0.125, -1.0e-7, -3.3]),
        "loss_mask": codec.pack_u8([1, 0, 1]),
        "finish_reason": "stop",
        "version_min": 3,
        "version_max": 4,
        "reference": json.dumps({"answer": "8"}),
        "worker_id": "rollout-0",
        "engine": "hf",
        "prompt_created_at_ms": 1_700_000_000_000,
        "metadata": {"k": "v"},
    }


def records() -> list[tuple[str, dict]]:
    return [
        ("Prompt", {"prompt_id": "p1", "group_id": "p1@0", "task": "math", "text": "1+1=", "group_size": 8,
                    "sample_count": 8, "created_at_ms": 5, "max_new_tokens": 16, "metadata": {"src": "gsm8k"}}),
        ("Trajectory", trajectory(1)),
        ("ScoredTrajectory", {"trajectory": trajectory(2), "reward": 0.75, "reward_details": {"exact_match": 1.0},
                              "scorer_id": "reward-1", "scored_at_ms": 9, "source_partition": 2, "source_offset": 77}),
        ("ScoredTrajectory", {"trajectory": None, "trajectory_value": codec.encode("Trajectory", trajectory(4)),
                              "reward": 0.5, "scorer_id": "reward-2", "scored_at_ms": 10}),  # what reward workers write
        ("WeightUpdate", {"version": 12, "uri": "s3://b/w/v12.safetensors", "sha256": "ab" * 32, "bytes": 1 << 33,
                          "step": 12, "created_at_ms": 10, "trainer_id": "trainer-0"}),
        ("Command", {"name": "stop", "args": {"reason": "done"}, "created_at_ms": 11}),
        ("MetricEvent", {"role": "trainer", "worker_id": "t0", "timestamp_ms": 12, "version": 3,
                         "metrics": {"loss": 0.5, "grad_norm": math.inf, "skipped": math.nan}}),
        ("DeadLetter", {"source_topic": "rl.rollouts", "source_partition": 1, "source_offset": 9, "key": b"g1",
                        "value": b"\x00\xffgarbage", "headers": {"rl.schema": b"Trajectory.v1"},
                        "error_type": "decode", "reason": "bad magic", "role": "reward", "worker_id": "r0",
                        "failed_at_ms": 13}),
        ("JobLease", {"run_id": "ab" * 16, "state": "held", "job": "next-digit", "pid": 4242, "pid_started": "1234",
                      "host": "gpu-7", "host_id": "b/pid:[4026531836]", "role_pids": ["4243:1300"],
                      "run_dir": "/runs/next-digit", "started_at_ms": 14, "written_at_ms": 15, "ttl_ms": 30000}),
    ]  # fmt: skip


@pytest.mark.kafka
def test_every_record_type_through_kafka_decodes_like_python(kafka_bootstrap):
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"t{uuid.uuid4().hex[:10]}.rollouts"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=60)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for name, rec in records():
        label = f"{name}.v{codec.schema_of(codec.encode(name, rec)).version}"
        producer.produce(topic, codec.encode(name, rec), key=name.encode(), headers={codec.SCHEMA_HEADER: label})
    assert producer.flush(60) == 0
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": topic, "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    values, deadline = [], time.monotonic() + 90
    try:
        while len(values) < len(records()) and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                values.append(msg.value())
    finally:
        consumer.close()
    assert len(values) == len(records())
    decoded = decode_with_java(values, topic=topic)
    for (name, _), value, got in zip(records(), values, decoded, strict=True):
        writer = codec.schema_of(value)
        assert got.get("schema") == writer.label and got["type"] == "JSON", got
        assert got["fingerprint"] == writer.fingerprint.hex()
        expected = as_json(codec.decode_as(value, name))
        assert f32(got["value"]) == f32(expected), name
    traj = decoded[1]["value"]
    assert traj["response_tokens"] == [8, 0, 3] and traj["logprobs"] == [-0.125, -1.0e-7, -3.3]
    assert traj["loss_mask"] == [1, 0, 1] and decoded[7]["value"]["key"] == base64.b64encode(b"g1").decode()
    assert decoded[3]["value"]["trajectory"]["group_id"] == "g4"  # the embedded trajectory, decoded


def test_bad_values_are_errors_and_old_data_reads_with_a_newer_schema(tmp_path):
    old = codec.encode("Trajectory", trajectory(3))
    bad = [b"hello, not avro", codec.MAGIC + b"\x01" * 8 + b"xyz", old[:30]]
    errors = decode_with_java(bad)
    assert "C3 01" in errors[0]["error"]
    assert "unknown schema fingerprint 0101010101010101" in errors[1]["error"]
    assert "corrupt Trajectory.v1 body" in errors[2]["error"]
    for f in (REPO / "schemas").glob("*.avsc"):
        shutil.copy(f, tmp_path / f.name)
    v2 = json.loads((tmp_path / "Trajectory.v1.avsc").read_text())
    v2["fields"].append({"name": "tool_calls", "type": ["null", "int"], "default": None})
    (tmp_path / "Trajectory.v2.avsc").write_text(json.dumps(v2))
    (got,) = decode_with_java([old], schemas=tmp_path)
    assert got["schema"] == "Trajectory.v1"  # the writer's version, found by fingerprint
    assert got["value"]["tool_calls"] is None and got["value"]["group_id"] == "g3"  # read as v2
