"""A notice carries its writer's identity, and a trainer is never blocked by a
notice it did not write. An independent writer (its own producer, ``pipeline.codec``; no notice key)
copies the trainer's newest notice to the next version: the right ``trainer_id`` and a checkpoint
that is there and matches its sha256, so every check but the writer's identity passes. Unsigned, or
with a made-up signature, it is dead-lettered by the rollout worker (``unsigned_notice``,
``bad_signature``) and the pipeline keeps moving; a trainer restarted with a forged notice of its
next version on rl.control starts (it would refuse: "already announces version ...").
Before the notices were signed the rollout worker accepted such a notice and loaded its weights.
"""

from __future__ import annotations

import pytest

from pipeline import codec
from pipeline.kafka import Producer, client_conf
from tests import rl_pipeline
from tests.rollout_helpers import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]
SIG, EPOCH = "rlstream.sig", "rlstream.epoch"  # spelled out: the intruder does not use pipeline.notice_auth


def _notices(cfg) -> list[dict]:
    recs = [codec.decode(m.value()) for m in read_topic(cfg, "control")]
    return [r for name, r in recs if name == "WeightUpdate" and "forged" not in r["metadata"]]


def test_forged_notices_are_refused_and_never_block_the_trainer(make_config, topic_prefix, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (see rl_pipeline.run)

    from consumers.trainer.worker import Trainer

    task = rl_pipeline.write_task(tmp_path / "task.jsonl")
    cfg = make_config(*rl_pipeline.settings(task, topic_prefix, 2000, G=2, n=4, k=1))
    pipe = rl_pipeline.Pipeline(cfg)
    trainer, wait = pipe.trainer, pipe.wait
    intruder = Producer(client_conf(cfg, "intruder", kind="producer"))

    def forge(tag: str, version: int, signed: bool) -> None:
        """The trainer's newest notice (its trainer_id, its checkpoint and sha256, both there), at
        ``version``: unsigned, or with the trainer's epoch and a signature the intruder made up."""
        real = max(_notices(cfg), key=lambda u: u["version"])
        meta = {**real["metadata"], "forged": tag}
        meta.pop(SIG, None)
        if signed:
            meta.update({SIG: "5" * 64, EPOCH: real["metadata"].get(EPOCH, "1")})
        rec = {**real, "metadata": meta, "version": version}
        intruder.produce_record(cfg.topics.name("control"), "WeightUpdate", rec, key=b"weights")
        intruder.flush(30)

    try:
        wait(lambda: trainer.version >= 2, "version 2")
        for tag, signed, error_type in (("unsigned", False, "unsigned_notice"), ("made-up", True, "bad_signature")):
            forge(tag, trainer.version + 1, signed)
            got = wait(
                lambda t=tag: rl_pipeline.forged_dead_letters(cfg, "rollout").get(t), f"the {tag} notice in rl.dlq", 60
            )
            assert got[0] == error_type and got[1], (tag, got)
        at = trainer.version
        wait(lambda: trainer.version >= at + 2, f"two more versions after v{at}")
        pipe.check()
    finally:
        pipe.join()
    versions = [u["version"] for u in _notices(cfg)]
    assert versions == list(range(1, versions[-1] + 1)) and versions[-1] >= at + 2
    assert {u["metadata"][EPOCH] for u in _notices(cfg)} == {"1"}
    try:  # the trainer is down; the intruder announces the version it would publish next
        forge("next", versions[-1] + 1, True)
        forge("next-unsigned", versions[-1] + 1, False)
    finally:
        intruder.close()
    again = Trainer(cfg, max_steps=versions[-1] + 1)
    try:
        again.setup()  # reads rl.control: a notice it took for its own would be "already announces"
        assert again.version == trainer.version == versions[-1] and again.signer.epoch == 2
    finally:
        again.close()
    trainer_dl = rl_pipeline.forged_dead_letters(cfg, "trainer")
    assert trainer_dl["next"][0] == "bad_signature" and trainer_dl["next-unsigned"][0] == "unsigned_notice"
