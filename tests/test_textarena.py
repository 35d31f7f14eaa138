"""The ``textarena`` environment: games of the textarena library (0.7.4) as episodes. Its options
are checked at start (the package missing, an unknown or two-player game, bad game arguments), an
episode renders the game's new messages in plain text or through a chat template, seeds make a
group's samples play the same game, and the game's own reward ends the episode. Through a real
rollout worker (real broker, tiny random-init model): every prompt committed, multi-turn
trajectories with observation tokens masked, and the game's reward as the RL reward in rl.scored;
and environments that raise or hang after several turns, in the same run as healthy episodes:
nothing lost, every failed episode in rl.dlq with its reason, the healthy neighbours finish."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading

import pytest

from pipeline import codec
from pipeline.errors import ConfigError
from pipeline.models import build_char_tokenizer
from producers.envs import EnvContext, env_factory

needs_textarena = pytest.mark.skipif(
    importlib.util.find_spec("textarena") is None,
    reason="textarena is not installed: pip install 'rlstream[textarena]' (scripts/setup.sh installs it)",
)
TEMPLATE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}<eos>\n{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
GUESS = {"env_id": "GuessTheNumber-v0", "kwargs": {"min_number": 1, "max_number": 9, "max_turns": 6}}
DATA = "tests/data/textarena.jsonl"


def game(tok=None, **options):
    cls = env_factory("textarena")
    opts = {**GUESS, **options}
    cls.check_options(opts)
    return cls(opts, EnvContext("textarena", "w", tok))


def prompt(group="g@e0", seed=None) -> dict:
    return {"group_id": group, "text": "Play.\n", "reference": json.dumps({"seed": seed}) if seed is not None else ""}


# -- options ---------------------------------------------------------------------------------------
def test_without_the_package_the_options_are_refused_with_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"pip install 'rlstream\[textarena\]'"):
        env_factory("textarena").check_options(GUESS)


@needs_textarena
def test_unknown_two_player_and_badly_configured_games_are_refused_at_start():
    cls = env_factory("textarena")
    for opts, match in (
        ({"env_id": "GuessTheNumbr-v0"}, "not a textarena game; did you mean GuessTheNumber-v0"),
        ({"env_id": "TicTacToe-v0"}, "cannot be played by one player"),
        ({"env_id": "GuessTheNumber-v0", "kwargs": {"nope": 1}}, "unexpected keyword argument 'nope'"),
        ({"env_id": "GuessTheNumber-v0", "render": "html"}, "render"),
        ({}, "env_id"),
    ):
        with pytest.raises((ConfigError, ValueError), match=match):
            cls.check_options(opts)
    for env_id in ("GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0"):  # no download needed
        cls.check_options({"env_id": env_id})


# -- an episode ------------------------------------------------------------------------------------
@needs_textarena
def test_a_plain_episode_shows_the_games_new_messages_and_ends_with_its_reward():
    env = game(build_char_tokenizer())
    assert not env.renders_chat and not env.eos_ends_episode
    opening = env.reset(prompt(seed=5), 0)
    assert opening.startswith("[GAME] You are Player 0. You are playing Guess The Number.\n")
    assert "between 1 and 9" in opening and opening.endswith("Enter your guess.\n")
    secret = env.base.game_number
    wrong = 1 if secret != 1 else 2
    r = env.step(f"[{wrong}]\n")
    assert (r.observation, r.reward, r.done) == ("[GAME] The target number is higher.\n" if wrong < secret
                                                 else "[GAME] The target number is lower.\n", 0.0, False)  # fmt: skip
    r = env.step("no idea")  # an invalid move: the game warns (its own rule: one warning)
    assert r.observation.startswith("\n[GAME] You attempted an invalid move.") and not r.done
    r = env.step(f"{secret}\n")  # the game's action wrapper adds the missing brackets
    assert (r.observation, r.reward, r.done) == ("", 1.0, True)
    assert "Congratulations" in r.info["reason"] and r.info["counts"]["games_finished"] == 1
    # two invalid moves in a row end the game with its own (partial) reward
    env.reset(prompt(seed=5), 0)
    env.step("what")
    r = env.step("now")
    assert r.done and r.reward == 0.0 and r.info["counts"]["games_ended_by_invalid_move"] == 1


@needs_textarena
def test_a_chat_episode_is_the_templates_rendering_of_the_game():
    tok = build_char_tokenizer(chat_template=TEMPLATE)
    env = game(tok, system_prompt="Answer like [3].")
    assert env.renders_chat
    opening = env.reset(prompt(seed=5), 0)
    assert opening.startswith("[system]Answer like [3].<eos>\n[user][GAME] You are Player 0.")
    assert opening.endswith("Enter your guess.<eos>\n[assistant]")
    secret = env.base.game_number
    wrong = 1 if secret != 1 else 2
    turn = f"[{wrong}]<eos>"
    r = env.step(turn)
    hint = "higher" if wrong < secret else "lower"
    assert r.observation == f"\n[user][GAME] The target number is {hint}.<eos>\n[assistant]"
    game_text = env.opening[-1]["content"]
    whole = tok.apply_chat_template(
        [{"role": "system", "content": "Answer like [3]."}, {"role": "user", "content": game_text},
         {"role": "assistant", "content": f"[{wrong}]"}, {"role": "user", "content": f"[GAME] The target number is {hint}."}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert opening + turn + r.observation == whole
    plain = game(tok, render="plain")
    assert not plain.renders_chat and plain.reset(prompt(seed=5), 0).startswith("[GAME]")
    forced = game(build_char_tokenizer(), render="chat")  # no template to render with: the episode fails
    with pytest.raises(ConfigError, match="chat template"):
        forced.reset(prompt(seed=5), 0)


@needs_textarena
def test_a_groups_samples_play_the_same_game_unless_seeded_by_sample():
    def secret(p, i, **o):
        env = game(**o)
        env.reset(p, i)
        return env.base.game_number

    assert len({secret(prompt("g@e0"), i) for i in range(4)}) == 1
    assert secret(prompt("g@e0"), 0) == secret(prompt("g@e0"), 0)  # deterministic
    assert len({secret(prompt(f"g{k}@e0"), 0) for k in range(12)}) > 1  # another group, another game
    assert len({secret(prompt("g@e0"), i, seed_by="sample") for i in range(12)}) > 1
    assert secret(prompt("a@e0", seed=7), 0) == secret(prompt("b@e3", seed=7), 0)  # the reference's seed wins


def test_the_task_generator_writes_one_seeded_game_per_record():
    from rlstream.tasks import textarena

    recs = textarena(count=20)
    assert recs == textarena(count=20) and len({r["reference"]["seed"] for r in recs}) == 20
    assert {r["task"] for r in recs} == {"textarena"} and all(r["prompt"] for r in recs)


# -- through the pipeline --------------------------------------------------------------------------
def runs(mask) -> list[tuple[int, int, int]]:
    """(mask value, start, end) of each run of model (1) and environment (0) tokens."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def inline(v) -> str:
    """``v`` as a TOML inline value (a ``--set`` override)."""
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {inline(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def pipeline_config(make_config, *extra: str, env: str = "textarena"):
    """The job of the pipeline tests. The worker exits after 8 s without work (counted from its
    partition assignment): a game turn waits on the environment's thread, which a loaded machine
    may hold up for seconds."""
    return make_config(
        f"feed.source={DATA}", "rl.group_size=3", "rl.max_staleness=100", "model.max_position_embeddings=1024",
        "rollout.max_new_tokens=400", "rollout.env.max_turns=5", "rollout.env.max_turn_tokens=4",
        "rollout.exit_when_idle_s=8", f'rollout.env.tasks={{textarena="{env}"}}',
        f"rollout.env.options={{textarena={inline(GUESS)}}}", *extra,
    )  # fmt: skip


@needs_textarena
@pytest.mark.kafka
def test_a_textarena_game_runs_through_rollout_and_reward_with_its_own_reward(make_config):
    from consumers.reward.worker import RewardWorker
    from pipeline.kafka import decode_message
    from producers import feed
    from tests.rollout_helpers import end_offsets
    from tests.test_reward_worker import read_all, running
    from tests.test_rollout import committed, run_until_idle, trajectories

    cfg = pipeline_config(
        make_config, 'reward.tasks={textarena=[{name="env_reward"}]}', "reward.default=[]", "reward.executor=thread"
    )
    feed.run(cfg)
    w = run_until_idle(cfg, timeout=300)  # a ~500-token opening per turn: slow on a loaded machine
    got = trajectories(cfg, 12)
    assert len(got) == 12 and len({t["trajectory_id"] for t in got}) == 12
    tok = w.worker.tokenizer
    multi = 0
    for t in got:
        opening = tok.decode(list(codec.unpack_i32(t["prompt_tokens"])))
        assert opening.startswith("[GAME] You are Player 0. You are playing Guess The Number.")
        toks, lps = list(codec.unpack_i32(t["response_tokens"])), list(codec.unpack_f32(t["logprobs"]))
        mask = codec.unpack_u8(t["loss_mask"])
        assert len(toks) == len(lps) == len(mask) <= 400 and mask[0] == 1
        assert t["finish_reason"] in ("env_done", "max_turns", "length")
        parts = runs(mask)
        assert len([p for p in parts if p[0] == 1]) == t["num_turns"] <= 5
        for _, a, b in (p for p in parts if p[0] == 0):  # observations: the game's messages, logprob 0
            assert "[GAME] " in tok.decode(toks[a:b]) and all(lp == 0.0 for lp in lps[a:b])
        reward = float(t["metadata"]["env_reward"])
        assert 0.0 <= reward <= 1.0 and (reward == 0.0 or t["finish_reason"] == "env_done")
        multi += t["num_turns"] > 1
    assert multi >= 6
    assert any(t["finish_reason"] == "env_done" for t in got)  # games the game itself ended
    ends = end_offsets(cfg, cfg.topics.name("prompts"))
    done = committed(cfg)
    assert all(done[p] == end for p, end in ends.items() if end)  # every prompt committed
    # the game's own reward is the RL reward (the built-in reward function env_reward)
    with running(RewardWorker(cfg)):
        scored = [decode_message(m, "ScoredTrajectory") for m in read_all(cfg, "scored", 12, timeout=180)]
    assert len(scored) == 12
    for s in scored:
        assert s["reward"] == pytest.approx(float(s["trajectory"]["metadata"]["env_reward"]))


RELEASE = threading.Event()
"""Set at the end of the fault test: the hung steps' abandoned threads then end."""
FAIL_AT = 3
"""The step (after this many model turns) at which a faulty episode raises or hangs."""


def faulty_env():
    from producers.textarena_env import TextArenaEnv

    class FaultyTextArenaEnv(TextArenaEnv):
        """Sample 0 plays as the model says. Samples 1 and 2 play moves the game accepts but never
        wins (a guess other than the secret, each once), so their games go on, and at step
        ``FAIL_AT`` sample 1's environment raises and sample 2's hangs (past step_timeout_s)."""

        def reset(self, prompt, sample_index):
            self.index, self.steps = sample_index, 0
            return super().reset(prompt, sample_index)

        def step(self, action):
            self.steps += 1
            if self.index and self.steps == FAIL_AT:
                if self.index == 1:
                    raise RuntimeError(f"the game server fell over after {self.steps - 1} moves")
                RELEASE.wait(60)
            if self.index:
                guesses = [n for n in range(1, 10) if n != self.base.game_number]
                action = f"[{guesses[self.steps - 1]}]\n"
            return super().step(action)

    return FaultyTextArenaEnv


FaultyTextArenaEnv = faulty_env() if importlib.util.find_spec("textarena") else None


@needs_textarena
@pytest.mark.kafka
def test_textarena_episodes_that_raise_or_hang_mid_game_are_dead_letters_and_nothing_is_lost(make_config):
    from producers import feed
    from tests.rollout_helpers import end_offsets, read_topic
    from tests.test_rollout import committed, run_until_idle, trajectories

    cfg = pipeline_config(
        make_config, "rollout.env.step_timeout_s=1", "rollout.env.workers=2", "rollout.env.max_turn_tokens=3",
        env="tests.test_textarena:FaultyTextArenaEnv",
    )  # fmt: skip
    feed.run(cfg)
    RELEASE.clear()
    try:
        w = run_until_idle(cfg, timeout=300)
        dead = [r for _, r in read_topic(cfg, "dlq", "DeadLetter", 8)]
        got = trajectories(cfg, 4)
    finally:
        RELEASE.set()
    assert len(dead) == 8 and len(got) == 4
    published = {t["trajectory_id"]: t for t in got}
    assert all(tid.endswith("/0") for tid in published)  # the healthy neighbours finished
    kinds = {}
    for d in dead:
        tid = d["headers"]["trajectory_id"].decode()
        kinds[tid] = d["error_type"]
        assert d["source_topic"] == cfg.topics.name("prompts") and d["role"] == "rollout"
        assert d["reason"].startswith(f"trajectory {tid} (turn {FAIL_AT}): ")
        episode = codec.decode_as(d["value"], "Trajectory")  # the episode so far: FAIL_AT turns
        assert episode["trajectory_id"] == tid and episode["num_turns"] == FAIL_AT
        mask = codec.unpack_u8(episode["loss_mask"])
        assert [v for v, _, _ in runs(mask)] == [1, 0] * (FAIL_AT - 1) + [1]
        if tid.endswith("/1"):
            assert "RuntimeError: the game server fell over after 2 moves" in d["reason"]
        else:
            assert "rollout.env.step_timeout_s = 1s" in d["reason"]
    assert {k for k, v in kinds.items() if v == "env_error"} == {t.replace("/0", "/1") for t in published}
    assert {k for k, v in kinds.items() if v == "env_timeout"} == {t.replace("/0", "/2") for t in published}
    assert not set(published) & set(kinds)  # 12 samples: 4 trajectories + 8 dead letters, none twice
    assert w.worker.env_steps.abandoned == 4
    ends = end_offsets(cfg, cfg.topics.name("prompts"))
    done = committed(cfg)
    assert all(done[p] == end for p, end in ends.items() if end)  # every prompt committed
