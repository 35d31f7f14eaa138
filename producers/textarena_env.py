"""The textarena environment (``textarena``): single-player games of the textarena library
(``textarena==0.7.4``, ``pip install 'rlstream[textarena]'``) played as multi-turn episodes, the
game's own reward as the episode's ``env_reward``.

Options (``[rollout.env.options.<task>]``, ``TextArenaOptions``): ``env_id`` (a registered game,
e.g. ``GuessTheNumber-v0``, ``TowerOfHanoi-v0``, ``Mastermind-v0``), ``kwargs`` (the game's
constructor arguments, over the registered ones), ``seed_by``, ``render`` and ``system_prompt``.

An episode is one game for player 0: ``reset`` makes the game (``ta.make``), resets it with
``num_players=1`` and a seed, and returns the game's opening messages (its prompt, its board);
``step(action)`` passes the model's turn (less the EOS or stop string that ended it) to the
game's ``step`` (through the game's action wrappers, e.g. the one that adds missing brackets) and returns the messages the game wrote since
(hints, boards, an invalid-move warning), and ``done`` when the game ends. The game's
observation wrappers are not used: they repeat the whole history every turn, while an episode's
context already holds it, so the adapter renders only the new messages, each as
``[GAME] message``; the player's own action is not repeated. When the game ends, the reward
``env.close()`` gives player 0 is the step's reward (the trajectory's ``metadata.env_reward``; the
built-in reward function ``env_reward`` makes it the RL reward), and the game's reason is in the
step's ``info``. An episode cut short by ``rollout.env.max_turns`` or the token budget before the
game ends gets no game reward (0).

The seed: the prompt's ``reference["seed"]`` if it has one (the ``textarena`` task generator
writes one per record), else one derived from the group id. ``seed_by = "group"`` (default) gives
every sample of a group the same game (the same secret number, the same board), so a group's
rewards compare like with like; ``"sample"`` adds the sample index (one game per sample).

Rendering: ``render = "chat"`` writes the opening as a user message through the tokenizer's chat
template and every observation as the template's next user message and assistant opening (as the
tools environment does); ``"plain"`` writes the messages as lines; ``"auto"`` (default) is chat when
the tokenizer has a template. Either way the model's EOS ends only its turn: the game decides when
the episode ends.

textarena's games draw from the process-wide ``random`` module, which ``reset`` seeds: resets are
serialized by a lock, so a game's start is reproducible from its seed. A game whose ``step`` draws
from ``random`` (2048's new tiles) is reproducible only as far as the interleaving of concurrent
steps allows. Games that download word lists when imported (Wordle, Hangman, Crosswords, ...) need
network access.

What this is not: a multi-player arena (two-player games are refused at start) nor a reward
function (the reward role scores the trajectory; ``env_reward`` reads the game's reward).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import threading
from typing import Any, Literal

from pydantic import Field

from pipeline.config import StrictModel
from pipeline.errors import ConfigError
from producers.envs import Environment, StepResult
from producers.tool_env import TURN_MARK, overlap

INSTALL = "pip install 'rlstream[textarena]'"
_RESET_LOCK = threading.Lock()
"""textarena seeds the process-wide ``random`` in ``reset``: one reset at a time."""


class TextArenaOptions(StrictModel):
    env_id: str = Field(min_length=1)
    """A single-player game registered in textarena, e.g. ``GuessTheNumber-v0``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The game's constructor arguments, over the registered ones (e.g. ``{max_number = 50}``)."""
    seed_by: Literal["group", "sample"] = "group"
    """``group``: every sample of a group plays the same game; ``sample``: one game per sample."""
    render: Literal["auto", "chat", "plain"] = "auto"
    """``chat``: through the tokenizer's chat template; ``plain``: text lines; ``auto``: chat if the
    tokenizer has a template."""
    system_prompt: str = ""
    """System message before the game's opening (chat rendering; plain: a first line)."""


def textarena():
    """The textarena module, or a ConfigError saying how to install it."""
    try:
        import textarena as ta
    except ImportError as exc:
        raise ConfigError(f"the textarena environment needs the textarena package: {INSTALL}") from exc
    return ta


def make_game(opts: TextArenaOptions):
    """A new game (``ta.make``), wrappers included; ConfigError for an unknown id or bad kwargs."""
    ta = textarena()
    from textarena.envs.registration import ENV_REGISTRY

    if opts.env_id not in ENV_REGISTRY:
        near = difflib.get_close_matches(opts.env_id, list(ENV_REGISTRY), n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise ConfigError(f"env_id {opts.env_id!r} is not a textarena game{hint}")
    try:
        return ta.make(opts.env_id, **opts.kwargs)
    except Exception as exc:
        raise ConfigError(
            f"textarena game {opts.env_id} with kwargs {opts.kwargs}: {type(exc).__name__}: {exc}"
        ) from exc


def unwrapped(game):
    """The game under its wrappers (its own ``get_observation``: the new messages, unrendered)."""
    ta = textarena()
    while isinstance(game, ta.Wrapper):
        game = game.env
    return game


def player_reward(closed) -> tuple[float, dict]:
    """Player 0's reward and game info from what ``env.close()`` returned."""
    rewards, info = closed if isinstance(closed, tuple) else (closed, {})
    reward = float((rewards or {}).get(0, 0.0))
    return reward, dict((info or {}).get(0, {})) if isinstance(info, dict) else {}


class TextArenaEnv(Environment):
    eos_ends_episode = False
    renders_chat = False
    """Set per instance from ``render`` (chat when the tokenizer's template renders the game)."""

    def __init__(self, config: dict[str, Any] | None = None, ctx=None):
        super().__init__(config, ctx)
        self.opts = TextArenaOptions.model_validate(self.config)
        self.tok = self.ctx.tokenizer
        self.has_template = bool(getattr(self.tok, "chat_template", None))
        self.renders_chat = self.opts.render == "chat" or (self.opts.render == "auto" and self.has_template)

    @classmethod
    def check_options(cls, options: dict[str, Any], import_dirs=()) -> None:
        opts = TextArenaOptions.model_validate(options)
        game = make_game(opts)
        try:  # a trial game: a two-player game refuses one player (textarena asserts)
            with _RESET_LOCK:
                game.reset(num_players=1, seed=None)
            players = unwrapped(game).state.num_players
            if players != 1:
                raise ValueError(f"it was reset for {players} players")
        except Exception as exc:
            raise ConfigError(
                f"textarena game {opts.env_id} cannot be played by one player: {type(exc).__name__}: {exc} "
                "(the textarena environment plays single-player games)"
            ) from exc

    # -- seeds and rendering ----------------------------------------------------------------------
    def seed(self, prompt: dict, sample_index: int) -> int:
        ref = prompt.get("reference") or ""
        ref = json.loads(ref) if isinstance(ref, str) and ref.strip().startswith("{") else ref
        if isinstance(ref, dict) and "seed" in ref:
            base = int(ref["seed"])
        else:
            base = int.from_bytes(hashlib.sha256(prompt["group_id"].encode()).digest()[:4], "little")
        return base + sample_index if self.opts.seed_by == "sample" else base

    def messages(self) -> str:
        """The game's messages since the last call, as ``[GAME] ...`` lines (the player's own
        actions left out: they are in the context already)."""
        ta = textarena()
        _, msgs = self.base.get_observation()
        roles = getattr(self.base.state, "role_mapping", {})
        lines = []
        for sender, text, kind in msgs:
            if kind == ta.ObservationType.PLAYER_ACTION:
                continue
            name = "GAME" if sender == ta.GAME_ID else roles.get(sender, f"Player {sender}")
            lines.append(f"[{name}] {text}")
        return "\n".join(lines)

    def _render(self, messages: list[dict]) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # -- an episode -------------------------------------------------------------------------------
    def reset(self, prompt: dict, sample_index: int) -> str:
        if self.renders_chat and not self.has_template:
            raise ConfigError("textarena: render = 'chat' needs a tokenizer with a chat template")
        self.game = make_game(self.opts)
        self.base = unwrapped(self.game)
        with _RESET_LOCK:
            self.game.reset(num_players=1, seed=self.seed(prompt, sample_index))
        opening = self.messages()
        if not self.renders_chat:
            head = f"{self.opts.system_prompt}\n" if self.opts.system_prompt else ""
            return f"{head}{opening}\n"
        system = [{"role": "system", "content": self.opts.system_prompt}] if self.opts.system_prompt else []
        self.opening = [*system, {"role": "user", "content": opening}]
        return self._render(self.opening)

    def observation(self, action: str, text: str) -> str:
        """The text after the model's turn ``action``: the game's new messages ``text`` as the next
        user message (chat) or lines (plain), then the next assistant opening."""
        if not self.renders_chat:
            return ("" if action.endswith("\n") else "\n") + (f"{text}\n" if text else "")
        msgs = [*self.opening, {"role": "assistant", "content": TURN_MARK}, {"role": "user", "content": text}]
        rendered = self._render(msgs)
        if rendered.count(TURN_MARK) != 1:
            raise ValueError("the chat template did not render the assistant message verbatim")
        tail = rendered.split(TURN_MARK, 1)[1]
        return tail[overlap(action, tail) :]

    def move(self, action: str) -> str:
        """What the game is given of the model's turn: its text without the EOS or stop string that
        ended it, or the whitespace around it (the game's action wrapper then adds brackets to a
        bare ``7``, not to ``7\\n``)."""
        eos = getattr(self.tok, "eos_token", None)
        if eos and action.endswith(eos):
            action = action[: -len(eos)]
        return action.strip()

    def step(self, action: str) -> StepResult:
        done, _ = self.game.step(self.move(action))
        text = self.messages()
        counts = {"game_turns": 1}
        if not done:
            return StepResult(self.observation(action, text), 0.0, False, {"counts": counts})
        reward, info = player_reward(self.game.close())
        counts["games_finished"] = 1
        counts["games_ended_by_invalid_move"] = int(bool(info.get("invalid_move")))
        return StepResult("", reward, True, {"counts": counts, "reason": info.get("reason", ""), "reward": reward})
