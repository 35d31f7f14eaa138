"""Checks before start: everything about a job that can be known before any process starts is
checked once, in the launching process, and a mistake is one ConfigError line that names the key
and the fix, instead of roles restarted in a loop over a mistake no restart can mend.

``check(cfg, data)``, in this order (cheap first; no model weights are loaded):

* **datasets**: ``feed.source`` (and ``eval.source`` when ``job.eval``) exists, is readable, parses
  in its format with the feed's reader and field names, and has records; ``data`` holds generated
  datasets not yet written (``rlstream.job.plan``);
* **rewards**: every ``reward.default`` and ``reward.tasks`` term builds, as a reward worker builds
  it (a ``module:function`` is imported with ``reward.import_dirs``, which ``rlstream run`` extends
  with the job file's directory); a task of the datasets without a reward is refused when there is
  no default;
* **environments**: every ``rollout.env.tasks`` class imports and is an ``Environment``, and
  accepts its options (``Environment.check_options``: e.g. the tools environment's tools load);
* **plug-ins**: every engine, loss or advantage estimator named by a ``module:Name`` path imports;
* **model**: ``model.path`` resolves, its config.json and tokenizer load (the tiny model's
  tokenizer is built in code); a GGUF not imported yet is checked through its own tokenizer;
* **chat template against the datasets**: prompts that ``rollout.chat_template`` renders with the
  tokenizer's chat template need one (the first such prompt is rendered), and ``never`` cannot
  take a chat record without prompt text.
* **demonstrations** (``feed.mode = "sft"``): every conversation renders as the feed will render
  it (``producers.sft``).

``rlstream.job.checked_start`` is the order every job run follows: these checks, then the cluster (the local
broker started if none is configured) and that it answers, and only then the generated data
written; the run dir and the topics come after (``run_job``). So a refused job has
created nothing.

What this is not: a dry run. What only a running pipeline shows (a reward function that raises on
some records, a prompt longer than the limit) still goes to rl.dlq with a reason.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


def check(cfg, data: dict[Path, str] | None = None) -> None:
    """Every check that needs no running process; ConfigError (one line) at the first failure."""
    t0 = time.monotonic()
    sets = datasets(cfg, data or {})
    rewards(cfg, {r["task"] for _, _, records in sets for r in records})
    environments(cfg)
    plugins(cfg)
    tok = tokenizer(cfg)
    chat_template(cfg, tok, sets)
    if cfg.feed.mode == "sft":
        demonstrations(cfg, tok, data or {})
    log.info("checks before start passed in %.1f s", time.monotonic() - t0)


# ---- datasets -------------------------------------------------------------------------------
def datasets(cfg, data: dict[Path, str]) -> list[tuple[str, Path, list[dict]]]:
    """``(key, path, normalized records)`` of the training set and, with ``job.eval``, the eval set."""
    from consumers.eval.worker import eval_feed

    out = [("feed.source", cfg.feed.source, _records("feed.source", cfg.feed, data))]
    if cfg.job.eval and cfg.eval.source is not None:
        out.append(("eval.source", cfg.eval.source, _records("eval.source", eval_feed(cfg), data)))
    return out


def _records(key: str, fc, data: dict[Path, str]) -> list[dict]:
    from libs.datasets import normalize, read_raw

    if fc.source is None:
        raise ConfigError(f'{key} is not set: give a dataset file ({key} = "train.jsonl") or a generated one '
                          '([job.dataset] generator = "...")')  # fmt: skip
    path = Path(fc.source)
    if path in data:  # generated, not written yet
        rows = [json.loads(line) for line in data[path].splitlines() if line.strip()]
    elif not path.exists():
        raise ConfigError(f"{key} {path} does not exist (relative paths are taken from the working directory)")
    else:
        try:
            rows = read_raw(path, fc.format)
        except ConfigError as exc:
            raise ConfigError(f"{key}: {exc}") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key} {path} cannot be read: {_line(exc)}") from exc
        except Exception as exc:  # bad JSON, a corrupt Parquet file or saved dataset: the reader's own error
            raise ConfigError(f"{key} {path} does not parse: {_line(exc)}") from exc
    records = normalize(rows, fc, f"{key} {path}")
    if not records:
        raise ConfigError(f"{key} {path} has no records")
    return records


# ---- rewards and environments ---------------------------------------------------------------
def rewards(cfg, tasks: set[str]) -> None:
    """Every reward term builds as a reward worker builds it; every task of the data has a reward."""
    from libs.rewards.base import build

    rc = cfg.reward
    ctx = {"sandbox": rc.sandbox, "import_dirs": rc.import_dirs}
    combos = [("reward.default", rc.default), *((f"reward.tasks.{t}", specs) for t, specs in rc.tasks.items())]
    for key, specs in combos:
        for spec in specs:
            try:
                build(spec.name, spec.kwargs, ctx)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from exc
    unscored = sorted(tasks - set(rc.tasks)) if not rc.default else []
    if unscored:
        raise ConfigError(f"reward.default is empty and reward.tasks has no entry for task {unscored[0]!r} of the "
                          f"dataset: add reward.tasks.{unscored[0]} or a reward.default")  # fmt: skip


def environments(cfg) -> None:
    """Every ``rollout.env.tasks`` entry imports, is an Environment and accepts its options (as a
    rollout worker loads it)."""
    from producers.envs import env_factory

    for task, spec in cfg.rollout.env.tasks.items():
        try:
            cls = env_factory(spec, cfg.rollout.env.import_dirs)
        except ConfigError as exc:  # (load_object's message names where it looked)
            raise ConfigError(f"rollout.env.tasks.{task}: {exc}") from exc
        try:
            cls.check_options(cfg.rollout.env.options.get(task, {}), cfg.rollout.env.import_dirs)
        except (ConfigError, ValueError) as exc:  # ValueError: a pydantic ValidationError of the options
            raise ConfigError(f"rollout.env.options.{task}: {exc}") from exc


def plugins(cfg) -> None:
    """Every plug-in named by its dotted path (``rollout.engine.type``, ``trainer.engine.type``,
    ``trainer.loss.type``, ``trainer.advantage.estimator``) imports and has that attribute (its
    module is imported here, as the role will import it; a built-in name needs no check)."""
    from pipeline.plugins import is_dotted, load_object

    named = {
        "rollout.engine.type": cfg.rollout.engine.type,
        "trainer.engine.type": cfg.trainer.engine.type,
        "trainer.loss.type": cfg.trainer.loss.type,
        "trainer.advantage.estimator": cfg.trainer.advantage.estimator,
    }
    for key, ref in named.items():
        if is_dotted(ref):
            try:
                load_object(ref)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from exc


# ---- model and chat template ----------------------------------------------------------------
def tokenizer(cfg):
    """The policy's tokenizer, as the roles will load it; its config.json is loaded too. No weights."""
    from pipeline.models import PretrainedModelConfig, build_char_tokenizer

    m = cfg.model
    if not isinstance(m, PretrainedModelConfig):
        return CharTokenizerCheck(m, build_char_tokenizer)  # what materialize saves, when a prompt needs it
    from pipeline.model_import import PACKAGED, default_dest, read_marker, resolve_model_path, source_file

    text = str(m.path)
    p = Path(text).expanduser()
    if text in PACKAGED or (p.is_file() and p.suffix == ".gguf"):
        gguf = source_file(text)  # ConfigError: not installed, no such file
        dest = default_dest(text, gguf)
        if read_marker(dest) is None:  # imported (~1 min) when the job starts: its tokenizer now
            return _load(f"model.path {text}: the GGUF tokenizer", _gguf_tokenizer, gguf)
        p = dest
    else:
        p = resolve_model_path(text)  # ConfigError in one line for anything but an HF directory
    from transformers import AutoConfig

    from pipeline.models import load_tokenizer

    _load(f"model.path {text}: config.json", AutoConfig.from_pretrained, str(p))
    return _load(f"model.path {text}: the tokenizer", load_tokenizer, p)


class CharTokenizerCheck:
    """The tiny model's tokenizer as the checks use it: its chat template at once, the tokenizer
    itself (``build_char_tokenizer``: transformers, ~0.7 s of a launcher's start beside the fork
    server's imports) only when a prompt is rendered through that template."""

    def __init__(self, model, build):
        self.chat_template = model.chat_template or None
        self._model, self._build, self._tok = model, build, None

    def apply_chat_template(self, *args, **kwargs):
        if self._tok is None:
            self._tok = self._build(self._model.charset, self._model.chat_template)
        return self._tok.apply_chat_template(*args, **kwargs)


def _gguf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _load(what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        raise ConfigError(f"{what} does not load: {_line(exc)}") from exc


def chat_template(cfg, tok, sets: list[tuple[str, Path, list[dict]]]) -> None:
    """``rollout.chat_template`` against the datasets (semantics: ``libs.chat.uses_template``)."""
    from libs.chat import render, uses_template
    from pipeline.records import InvalidRecord

    rc = cfg.rollout
    mode = rc.chat_template
    for key, path, records in sets:
        if mode == "never":
            bare = next((i for i, r in enumerate(records) if r.get("messages") and not r["text"]), None)
            if bare is not None:
                raise ConfigError(
                    f'rollout.chat_template = "never", but {key} {path} has chat messages without prompt text '
                    f"(record {bare}): only a chat template renders messages. Set rollout.chat_template = "
                    f'"auto" with a model that has a template{_template_hint(cfg)}, or give each record a '
                    f"{cfg.feed.prompt_field!r} field"
                )
            continue
        first = next((i for i, r in enumerate(records) if uses_template(r, mode)), None)
        if first is None:
            continue
        if not getattr(tok, "chat_template", None):
            what = "has chat messages" if records[first].get("messages") else 'is rendered as chat ("always")'
            plain = (
                f"give each record a {cfg.feed.prompt_field!r} field instead of messages"
                if records[first].get("messages")
                else 'set rollout.chat_template = "auto"'
            )
            raise ConfigError(
                f"{key} {path} {what} (record {first}), but the model's tokenizer has no chat template: use a "
                f"model that has one{_template_hint(cfg)}, or {plain}"
            )
        try:
            render(records[first], tok, rc.system_prompt, rc.add_generation_prompt)
        except InvalidRecord as exc:
            raise ConfigError(f"{key} {path} record {first}: {exc.reason}") from exc


def demonstrations(cfg, tok, data: dict[Path, str]) -> None:
    """``feed.mode = "sft"``: every conversation renders as a demonstration (``producers.sft``)."""
    from producers.sft import render_all

    if isinstance(tok, CharTokenizerCheck):
        tok = tok._build(tok._model.charset, tok._model.chat_template)
    path = Path(cfg.feed.source)
    if path in data:
        rows = [json.loads(line) for line in data[path].splitlines() if line.strip()]
    else:
        from libs.datasets import read_raw

        rows = read_raw(path, cfg.feed.format)
    render_all(cfg, rows, tok, f"feed.source {path}")
    total = len(rows) * cfg.feed.epochs
    if cfg.feed.limit:
        total = min(total, cfg.feed.limit)
    per_step, steps = cfg.rl.groups_per_step, cfg.trainer.max_steps
    if steps and total < per_step * steps:
        raise ConfigError(
            f"feed.source {path}: {len(rows)} demonstrations x {cfg.feed.epochs} epoch(s) fill "
            f"{total // per_step} steps of rl.groups_per_step = {per_step}, but trainer.max_steps = {steps}: "
            f"set trainer.max_steps = {total // per_step}, or raise feed.epochs"
        )


def _template_hint(cfg) -> str:
    from pipeline.models import PretrainedModelConfig

    if isinstance(cfg.model, PretrainedModelConfig):
        return " (chat_template.jinja, or chat_template in tokenizer_config.json, in model.path)"
    return " (the tiny model takes one in model.chat_template)"


def _line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
