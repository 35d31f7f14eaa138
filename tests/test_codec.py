"""Avro codec: round trips, packed arrays, typed errors, schema evolution."""

import json
import random
import shutil

import pytest

import schemas
from pipeline import codec
from pipeline.errors import DecodeError, SerializationError


def make_trajectory(i: int = 0, n_tokens: int = 16, rng: random.Random | None = None) -> dict:
    rng = rng or random.Random(i)
    return {
        "trajectory_id": f"g{i}/0",
        "group_id": f"g{i}",
        "prompt_id": f"p{i}",
        "sample_index": 0,
        "group_size": 4,
        "task": "copy",
        "prompt_text": "abc",
        "response_text": "abc",
        "prompt_tokens": codec.pack_i32([rng.randrange(1 << 31) for _ in range(n_tokens)]),
        "response_tokens": codec.pack_i32([rng.randrange(1 << 31) for _ in range(n_tokens)]),
        "logprobs": codec.pack_f32([-rng.random() for _ in range(n_tokens)]),
        "loss_mask": b"",
        "finish_reason": "stop",
        "version_min": 3,
        "version_max": 4,
        "reference": json.dumps({"answer": "abc"}),
        "worker_id": "w0",
        "prompt_created_at_ms": 1,
        "gen_started_at_ms": 2,
        "gen_finished_at_ms": 3,
        "metadata": {"k": "v"},
    }


def test_every_schema_has_a_unique_fingerprint():
    infos = schemas.all_schemas()
    assert {s.name for s in infos} >= {
        "Prompt",
        "Trajectory",
        "ScoredTrajectory",
        "WeightUpdate",
        "MetricEvent",
        "DeadLetter",
    }
    assert len({s.fingerprint for s in infos}) == len(infos)


def test_trajectory_round_trip_and_packing():
    t = make_trajectory(7, 300)
    data = codec.encode("Trajectory", t)
    assert data[:2] == codec.MAGIC
    name, back = codec.decode(data)
    assert name == "Trajectory"
    for k, v in t.items():
        assert back[k] == v, k
    assert back["engine"] == "" and back["num_turns"] == 1  # defaults filled
    toks = list(codec.unpack_i32(back["response_tokens"]))
    assert len(toks) == 300 and toks == list(codec.unpack_i32(t["response_tokens"]))
    assert codec.pack_f32([0.5, -1.25]) == b"\x00\x00\x00?\x00\x00\xa0\xbf"  # little-endian float32
    assert codec.pack_i32([1, -1]) == b"\x01\x00\x00\x00\xff\xff\xff\xff"


def test_scored_trajectory_nests_trajectory():
    rec = {
        "trajectory": make_trajectory(1),
        "reward": 1.0,
        "reward_details": {"exact": 1.0},
        "scorer_id": "r0",
        "scored_at_ms": 5,
    }
    assert codec.decode_as(codec.encode("ScoredTrajectory", rec), "ScoredTrajectory")["trajectory"]["group_id"] == "g1"


def test_typed_errors():
    with pytest.raises(DecodeError, match="bad magic"):
        codec.decode(b"hello world, not avro")
    with pytest.raises(DecodeError) as ei:
        codec.decode(codec.MAGIC + b"\x00" * 8 + b"xyz")
    assert ei.value.error_type == "schema"
    good = codec.encode("Trajectory", make_trajectory())
    with pytest.raises(DecodeError, match="corrupt"):
        codec.decode(good[:40])
    with pytest.raises(DecodeError, match="expected Prompt"):
        codec.decode(good, "Prompt")
    with pytest.raises(SerializationError, match="Trajectory"):
        codec.encode("Trajectory", {"trajectory_id": 5})
    with pytest.raises(DecodeError, match="tombstone"):
        codec.decode(None)
    err = DecodeError("x").located("rl.rollouts", 3, 42)
    assert (err.topic, err.partition, err.offset) == ("rl.rollouts", 3, 42)
    assert "partition=3 offset=42" in str(err)


def test_schema_evolution_new_optional_field(tmp_path, monkeypatch):
    """Data written with Trajectory.v1 is read by a newer v2 that adds an optional field."""
    old = codec.encode("Trajectory", make_trajectory(3))
    for f in schemas.SCHEMA_DIR.glob("*.avsc"):
        shutil.copy(f, tmp_path / f.name)
    v2 = json.loads((tmp_path / "Trajectory.v1.avsc").read_text())
    v2["fields"].append({"name": "tool_calls", "type": ["null", "int"], "default": None})
    (tmp_path / "Trajectory.v2.avsc").write_text(json.dumps(v2))
    monkeypatch.setattr(schemas, "SCHEMA_DIR", tmp_path)
    for fn in (schemas.all_schemas, schemas.latest, schemas.by_fingerprint):
        fn.cache_clear()
    try:
        assert schemas.latest("Trajectory").version == 2
        name, rec = codec.decode(old)  # writer v1 (by fingerprint), reader v2
        assert name == "Trajectory" and rec["tool_calls"] is None and rec["group_id"] == "g3"
        new = codec.encode("Trajectory", {**make_trajectory(4), "tool_calls": 2})
        assert codec.decode(new)[1]["tool_calls"] == 2
        assert codec.schema_of(new).version == 2 and codec.schema_of(old).version == 1
    finally:
        for fn in (schemas.all_schemas, schemas.latest, schemas.by_fingerprint):
            fn.cache_clear()


def test_missing_bytes_field_takes_its_default():
    t = make_trajectory()
    del t["loss_mask"]
    assert codec.decode_as(codec.encode("Trajectory", t), "Trajectory")["loss_mask"] == b""
    rec = {"trajectory": t, "reward": 0.5, "scorer_id": "r", "scored_at_ms": 1}
    assert codec.decode_as(codec.encode("ScoredTrajectory", rec), "ScoredTrajectory")["trajectory"]["loss_mask"] == b""
    assert "loss_mask" not in t  # the caller's record is not modified


def test_scored_v2_carries_the_original_trajectory_bytes_and_v1_still_reads():
    import io

    import fastavro

    t = make_trajectory(5)
    raw = codec.encode("Trajectory", t)
    v2 = codec.encode("ScoredTrajectory", {"trajectory": None, "trajectory_value": raw, "reward": 1.0,
                                           "scorer_id": "r", "scored_at_ms": 1})  # fmt: skip
    assert raw in v2  # byte for byte, not re-encoded
    rec = codec.decode_as(v2, "ScoredTrajectory")
    assert rec["trajectory"]["trajectory_id"] == "g5/0" and rec["trajectory"]["logprobs"] == t["logprobs"]
    v1 = next(s for s in schemas.all_schemas() if s.label == "ScoredTrajectory.v1")
    buf = io.BytesIO(codec.MAGIC + v1.fingerprint)
    buf.seek(0, 2)
    fastavro.schemaless_writer(buf, v1.parsed, {"trajectory": t, "reward": 0.5, "reward_details": {}, "scorer_id": "r",
                                                "scored_at_ms": 1, "score_latency_ms": 0.0, "source_partition": 1,
                                                "source_offset": 2})  # fmt: skip
    old = codec.decode_as(buf.getvalue(), "ScoredTrajectory")
    assert old["trajectory"] == rec["trajectory"] and old["trajectory_value"] == b"" and old["source_offset"] == 2
