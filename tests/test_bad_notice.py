"""One bogus notice on rl.control must not brick a job. An independent writer (its
own producer, ``pipeline.codec``; not the trainer) puts each kind of bad WeightUpdate on a running
pipeline's control topic: no uri, a version far ahead, a version behind, a checkpoint that is not
there, a sha256 that does not match. The intruder signs them with the job's notice key (as a
trainer with a bug would: an intruder without the key is tests/test_forged_notice.py), so they
reach the checks behind the signature. Each is dead-lettered on rl.dlq with its reason and skipped;
the rollout worker keeps generating, the trainer keeps stepping and versions keep advancing; a
trainer restarted afterwards is not blocked by notices it did not write.
"""

from __future__ import annotations

import threading

import pytest

from pipeline import codec
from pipeline.kafka import Producer, client_conf
from pipeline.notice_auth import epoch_of, load_key, sign
from tests import rl_pipeline
from tests.rollout_helpers import read_topic

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _notices(cfg) -> list[dict]:
    """The trainer's own WeightUpdates on rl.control, in order."""
    recs = [codec.decode(m.value()) for m in read_topic(cfg, "control")]
    return [r for name, r in recs if name == "WeightUpdate" and r["trainer_id"] == cfg.trainer.trainer_id]


def _newest(cfg) -> dict:
    return max(_notices(cfg), key=lambda u: u["version"])


def test_bad_notices_are_dead_lettered_and_the_pipeline_keeps_moving(make_config, topic_prefix, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (see rl_pipeline.run)

    from consumers.trainer.worker import Trainer

    task = rl_pipeline.write_task(tmp_path / "task.jsonl")
    # prompts for far more versions than the test waits for: the trainer steps about once a second
    # while the unverifiable notices are retried (2 s, 4 s), and a feed that runs dry stops the
    # versions the last wait counts on (CI on a loaded machine ran out at v192 with 40 steps' worth)
    cfg = make_config(*rl_pipeline.settings(task, topic_prefix, 2000, G=2, n=4, k=1))
    pipe = rl_pipeline.Pipeline(cfg)  # without the fix, the rollout worker dies on the first bad notice
    trainer, wait = pipe.trainer, pipe.wait
    intruder = Producer(client_conf(cfg, "intruder", kind="producer"))
    # The trainer steps about once a second here and the rollout worker can be a version or two
    # behind it: a notice forged at the trainer's next version then reads as implausible to the
    # worker, or the real notice of that version overtakes it (CI, alone, lost all four tries that
    # way once). So the trainer is held between two steps while a notice is forged and read.
    gate, parked = threading.Event(), threading.Event()
    gate.set()
    step = trainer.run_once

    def gated_step():
        if not gate.is_set():
            parked.set()
            gate.wait(120)
            parked.clear()
        return step()

    trainer.run_once = gated_step

    def hold_trainer() -> None:
        gate.clear()
        wait(parked.is_set, "the trainer to stop between two steps")
        follower = pipe.rollout.weights.control
        wait(lambda: follower.newest >= trainer.version, f"the rollout worker to know v{trainer.version}")

    def forge(kind: str, **fields) -> None:
        """The intruder's notice: the trainer's newest one, changed, at the next version by default
        (read from the trainer in-process, held between two steps)."""
        rec = {**real, "metadata": {"forged": kind}, "trainer_id": "", "version": trainer.version + 1, **fields}
        rec = sign(rec, key, epoch_of(real))  # past the signature check: the checks behind it
        intruder.produce_record(cfg.topics.name("control"), "WeightUpdate", rec, key=b"weights")
        intruder.flush(30)

    junk = tmp_path / "junk.safetensors"  # there and readable, but not what any sha256 says
    junk.write_bytes(b"not the weights" * 100)
    bad = {
        "no_uri": ("missing_uri", {"uri": ""}),
        "far_ahead": ("implausible_version", {"version": 10**6}),
        "behind": ("version_behind", {"version": 0}),
        "missing_checkpoint": ("unverifiable_checkpoint", {"uri": str(tmp_path / "nowhere.safetensors")}),
        "sha_mismatch": ("unverifiable_checkpoint", {"uri": str(junk), "sha256": "0" * 64}),
    }
    try:
        wait(lambda: trainer.version >= 2, "version 2")
        real = _newest(cfg)
        key = load_key(cfg.store)
        for kind, (error_type, fields) in bad.items():
            for attempt in range(4):
                tag = f"{kind}#{attempt}"
                try:
                    hold_trainer()
                    forge(tag, **fields)
                    if kind == "missing_checkpoint":  # retried until the trainer's own notice supersedes it
                        gate.set()
                    got = wait(
                        lambda t=tag: rl_pipeline.forged_dead_letters(cfg).get(t), f"the {kind} notice in rl.dlq", 60
                    )
                except AssertionError as exc:
                    if "timed out" not in str(exc):
                        raise
                    continue  # the real notice of its version came first and was loaded: never fetched
                finally:
                    gate.set()
                assert got[1], (kind, got)
                if got[0] == error_type:
                    break
                # a plausible notice the trainer overtook before the worker read it: again
                assert got[0] in ("version_behind", "implausible_version"), (kind, got)
            else:
                raise AssertionError(f"the {kind} notice never reached rl.dlq as {error_type}")
        at = trainer.version
        wait(lambda: trainer.version >= at + 2, f"two more versions after v{at}")
        pipe.check()
    finally:
        intruder.close()
        pipe.join()
    # versions kept advancing in order: every notice the trainer wrote is there, none skipped
    versions = [u["version"] for u in _notices(cfg)]
    assert versions == list(range(1, versions[-1] + 1)) and versions[-1] >= at + 2
    # a restarted trainer reads rl.control (v1000000 included) and is not blocked by it
    again = Trainer(cfg, max_steps=versions[-1] + 1)
    try:
        again.setup()  # reads rl.control: "already announces" would refuse to start
        assert again.version == trainer.version
    finally:
        again.close()
