"""Semantic validation (pipeline.records) at the first role that can tell: nonsense that decodes
goes to rl.dlq with a typed reason, its neighbours are unaffected, and a step never reports as
used a sample whose update was skipped."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from pipeline import codec
from pipeline.records import InvalidRecord, check_prompt, check_scored, check_trajectory
from tests.test_trainer import TINY, ScoredProducer, read_topic, scored

GOOD_PROMPT = {
    "prompt_id": "p", "group_id": "p@e0", "group_seq": 3, "task": "t", "text": "hi", "group_size": 2,
    "sample_start": 0, "sample_count": 2, "reference": "", "epoch": 0, "max_new_tokens": None,
    "created_at_ms": 0, "metadata": {},
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"group_seq": -1_000_000}, "group_seq"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": -5}, "max_new_tokens"),
        ({"text": ""}, "empty prompt"),
        ({"text": "x" * (2 << 20)}, "characters"),
        ({"group_size": 0}, "group_size"),
        ({"sample_start": 1, "sample_count": 2}, "do not fit"),
    ],
)
def test_nonsense_prompts_are_invalid(change, why):
    check_prompt(GOOD_PROMPT)
    with pytest.raises(InvalidRecord, match=why):
        check_prompt({**GOOD_PROMPT, **change})


def _traj(**change) -> dict:
    t = copy.deepcopy(scored("g", 0, 2, 1, 1.0))
    t["trajectory"].update(change)
    return t


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"version_min": 3, "version_max": 2}, "versions"),
        ({"version_min": -1}, "versions"),
        ({"logprobs": codec.pack_f32([math.nan, -1.0, -1.0])}, "logprobs"),
        ({"logprobs": codec.pack_f32([math.inf] * 3)}, "logprobs"),
        ({"response_tokens": b""}, "empty"),
        ({"prompt_tokens": codec.pack_i32([-4, 5])}, "negative token"),
        ({"sample_index": 5}, "sample_index"),
        ({"group_seq": -9}, "group_seq"),
        ({"response_text": "y" * (2 << 20)}, "characters"),
        ({"prompt_tokens": b"\x01\x02\x03"}, "multiple of 4"),
    ],
)
def test_nonsense_trajectories_are_invalid(change, why):
    rec = _traj()
    n = len(codec.unpack_i32(rec["trajectory"]["response_tokens"]))
    rec["trajectory"]["logprobs"] = codec.pack_f32([-1.0] * n)
    rec["trajectory"]["loss_mask"] = b""
    check_trajectory(rec["trajectory"])
    if "logprobs" in change:  # keep the lengths consistent: only the values are wrong
        rec["trajectory"]["response_tokens"] = codec.pack_i32([5] * len(codec.unpack_f32(change["logprobs"])))
    rec["trajectory"].update(change)
    with pytest.raises(InvalidRecord, match=why):
        check_trajectory(rec["trajectory"])


def test_what_only_the_trainer_can_check():
    rec = _traj()
    check_scored(rec, vocab_size=90, max_len=64)
    with pytest.raises(InvalidRecord, match="not finite"):
        check_scored({**rec, "reward": math.nan})
    with pytest.raises(InvalidRecord, match="vocabulary"):
        check_scored(rec, vocab_size=10)
    with pytest.raises(InvalidRecord, match="model's 4") as ei:
        check_scored(rec, max_len=4)
    assert ei.value.error_type == "too_long"


def test_samples_of_a_skipped_update_are_not_reported_used(tmp_path):
    """A non-finite gradient skips the update: train_samples names the samples it cost."""
    pytest.importorskip("torch")
    from consumers.trainer.batch import sample_from_record
    from consumers.trainer.engines import TrainContext, build_engine
    from consumers.trainer.step import train_samples
    from pipeline.models import materialize
    from rlstream.config import load_config

    cfg = load_config(None, [*TINY, f"run_dir={tmp_path}", "trainer.minibatches=2"], environ={})
    engine = build_engine(cfg.trainer.engine, TrainContext(materialize(cfg.model), cfg.trainer))
    samples = [sample_from_record(scored("g", i, 4, 0, float(i)), 0, i) for i in range(4)]
    for s in samples:
        s.advantage = 1.0
    calls = []

    class NanOnce:  # the first minibatch's loss (and gradient) is NaN, the second is fine
        needs_entropy = needs_prox_logp = False  # what a step loss declares (losses.LossFn)

        def __call__(self, logp, mb):
            calls.append(mb.ids)
            loss = (logp * mb.token_mask).sum() * mb.weights.sum()
            return (loss * math.nan if len(calls) == 1 else loss), {}

    out = train_samples(engine, samples, cfg.trainer, NanOnce(), step=1)
    assert out["skipped"] == 1 and out["optimizer_steps"] == 2
    assert sorted(out["skipped_ids"]) == sorted(calls[0])


@pytest.mark.kafka
def test_poison_records_are_dead_lettered_and_their_neighbours_train(make_config):
    """Token ids outside the vocabulary (the old crash loop: IndexError in every restart), NaN
    logprobs and rewards, inverted versions: each goes to rl.dlq with its reason; the valid groups
    around them train; no step has a non-finite loss."""
    from consumers.trainer.state import read_steps_log
    from consumers.trainer.worker import Trainer

    cfg = make_config(*TINY, "rl.group_size=2", "rl.groups_per_step=1", "topics.scored.partitions=1")
    out_of_vocab = scored("bad1", 0, 2, 0, 1.0)
    out_of_vocab["trajectory"]["response_tokens"] = codec.pack_i32([5, 10**6, 7, 8, 9, 10, 11, 12][:3])
    out_of_vocab["trajectory"]["logprobs"] = codec.pack_f32([-1.0] * 3)
    out_of_vocab["trajectory"]["loss_mask"] = b""
    nan_reward = {**scored("bad2", 0, 2, 0, 1.0), "reward": math.nan}
    nan_logprob = scored("bad3", 0, 2, 0, 1.0)
    n = len(codec.unpack_f32(nan_logprob["trajectory"]["logprobs"]))
    nan_logprob["trajectory"]["logprobs"] = codec.pack_f32([math.nan] * n)
    inverted = scored("bad4", 0, 2, 0, 1.0)
    inverted["trajectory"]["version_max"] = -1
    good = [[scored(f"ok{g}", i, 2, g, float(i), seq=g) for i in range(2)] for g in range(3)]  # fresh at step g
    sp = ScoredProducer(cfg)
    sp.send([*good[0], out_of_vocab, nan_reward])
    sp.send([nan_logprob, *good[1], inverted])
    sp.send(good[2])
    sp.close()

    assert Trainer(cfg, max_steps=3).run() == 3
    steps = read_steps_log(Path(cfg.run_dir) / "trainer")
    assert sorted(sorted(s["used"]) for s in steps) == [[f"ok{g}/0", f"ok{g}/1"] for g in range(3)]
    assert all(math.isfinite(s["loss"]) for s in steps)
    dlq = {r["reason"].split(":")[0]: r for name, r in read_topic(cfg, "dlq") if name == "DeadLetter"}
    assert set(dlq) == {"bad1/0", "bad2/0", "bad3/0", "bad4/0"}
    assert "vocabulary" in dlq["bad1/0"]["reason"] and "not finite" in dlq["bad2/0"]["reason"]
    assert "logprobs" in dlq["bad3/0"]["reason"] and "versions" in dlq["bad4/0"]["reason"]
    assert {r["error_type"] for r in dlq.values()} == {"invalid"}
