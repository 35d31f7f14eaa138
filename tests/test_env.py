"""Environment-level async: the guess-the-number environment and multi-turn rollouts with masks."""

import pytest
import torch

from pipeline import codec
from pipeline.errors import ConfigError
from pipeline.models import load_model, load_tokenizer, materialize
from producers import feed
from producers.envs import Environment, GuessNumberEnv, env_factory
from tests.test_engine_hf import teacher_forced_logprobs
from tests.test_rollout import run_until_idle, trajectories

FEEDBACK = {"higher\n", "lower\n", "correct\n", "invalid\n"}


def test_guess_number_env():
    env = GuessNumberEnv()
    p = {"group_id": "g@e0", "text": "Guess!\n", "reference": '{"lo": 1, "hi": 9, "secret": 4}'}
    assert env.reset(p, 0) == "Guess!\n"
    assert env.step("abc").observation == "invalid\n"
    assert env.step("I say 2\n").observation == "higher\n"
    assert env.step("7").observation == "lower\n"
    r = env.step("4\n")
    assert (r.observation, r.done, r.reward) == ("correct\n", True, 1.0)
    env.reset({**p, "reference": ""}, 3)
    secret = env.secret
    env.reset({**p, "reference": ""}, 3)
    assert env.secret == secret and 1 <= secret <= 100  # derived from group and sample, deterministic
    assert env_factory("guess_number") is GuessNumberEnv
    assert issubclass(env_factory("producers.envs:GuessNumberEnv"), Environment)
    with pytest.raises(ConfigError, match="unknown environment"):
        env_factory("nope")


@pytest.mark.kafka
def test_multi_turn_rollouts_mask_environment_tokens(make_config):
    cfg = make_config(
        "feed.source=tests/data/guess.jsonl", "rl.group_size=3", "rl.max_staleness=100",
        "rollout.max_new_tokens=60", "rollout.env.max_turns=4", "rollout.env.max_turn_tokens=5",
        "rollout.exit_when_idle_s=2",
    )  # fmt: skip
    feed.run(cfg)
    run_until_idle(cfg)
    got = trajectories(cfg, 12)
    assert len(got) == 12
    d = materialize(cfg.model)
    tok, model = load_tokenizer(d), load_model(d)
    multi = 0
    for t in got:
        toks = list(codec.unpack_i32(t["response_tokens"]))
        lps = list(codec.unpack_f32(t["logprobs"]))
        mask = codec.unpack_u8(t["loss_mask"])
        assert len(toks) == len(lps) == len(mask) <= 60
        assert t["finish_reason"] in ("env_done", "max_turns", "length", "stop")
        # split into runs of model (1) and environment (0) tokens
        runs, start = [], 0
        for i in range(1, len(mask) + 1):
            if i == len(mask) or mask[i] != mask[start]:
                runs.append((mask[start], start, i))
                start = i
        model_runs = [r for r in runs if r[0] == 1]
        env_runs = [r for r in runs if r[0] == 0]
        assert runs[0][0] == 1 and len(model_runs) == t["num_turns"] <= 4
        for _, a, b in env_runs:
            text = tok.decode(toks[a:b])
            assert text in FEEDBACK or (b == len(toks) and any(f.startswith(text) for f in FEEDBACK))
            assert all(lp == 0.0 for lp in lps[a:b])
        for _, a, b in model_runs:
            assert b - a <= 5
        if t["num_turns"] > 1:
            multi += 1
        # every model token's logprob is the policy's, given all previous turns and observations
        ref = teacher_forced_logprobs(model, list(codec.unpack_i32(t["prompt_tokens"])), toks)
        sel = torch.tensor(mask, dtype=torch.bool)
        assert torch.allclose(ref[sel], torch.tensor(lps)[sel], atol=1e-4)
    assert multi >= 6
