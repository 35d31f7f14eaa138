"""What a decoded record must mean, beyond what its Avro schema already fixes: positive budgets,
consistent versions, finite numbers, arrays of matching lengths, sane sizes, non-negative
sequence numbers and token ids.

Each check raises ``InvalidRecord`` (a ``DecodeError`` with ``error_type`` ``invalid`` or
``too_long``), so the role that finds it dead-letters the record with the reason and goes on; its
neighbours are unaffected. The first role that can tell checks: the rollout worker checks
Prompts, the reward worker Trajectories, the trainer ScoredTrajectories (again, since anyone may
write to rl.scored) plus what only it knows (token ids below the model's vocabulary, lengths
within its context).

``dead_letter``: the DeadLetter record of a refused message (for rl.dlq), whichever role refuses it.

What this is not: decoding (``pipeline.codec``) or a policy on what to do with a bad record.
"""

from __future__ import annotations

import math
import time

import numpy as np

from pipeline.errors import DecodeError

MAX_TEXT_CHARS = 1 << 20
"""Longest text field accepted (characters)."""
MAX_TOKENS = 1 << 20
"""Most tokens in one prompt or response."""


class InvalidRecord(DecodeError):
    """A record that decodes but cannot be used; ``error_type`` is ``invalid`` or ``too_long``."""

    def __init__(self, reason: str, error_type: str = "invalid"):
        super().__init__(reason, error_type=error_type)


# ---- WeightUpdate (rl.control) ----------------------------------------------------------------
HF_DIR_KEY = "hf_dir"
"""WeightUpdate metadata key of the version's HF model directory (written with ``trainer.publish_hf``)."""


def update_kind(update: dict) -> str:
    """A WeightUpdate's kind: ``full`` or ``adapter`` (a v1 notice has none: full weights)."""
    return update.get("kind") or "full"


def update_format(update: dict) -> str:
    """The weights' file format a WeightUpdate names (a v1 notice has none: one safetensors file)."""
    return update.get("format") or "safetensors"


def update_adapter(update: dict) -> dict:
    """A LoRA WeightUpdate's adapter fields, normalized: ``rank`` (0 = not given), ``alpha`` (0.0 =
    not given), ``target_modules`` (sorted; [] = not given) and ``base_sha256`` ('' = not given)."""
    return {
        "rank": int(update.get("adapter_rank") or 0),
        "alpha": float(update.get("adapter_alpha") or 0.0),
        "target_modules": sorted(update.get("adapter_target_modules") or []),
        "base_sha256": update.get("base_sha256") or "",
    }


def adapter_fields(rank: int, alpha: float, target_modules) -> dict:
    """The WeightUpdate fields that describe a LoRA adapter (the writer's side of ``update_adapter``)."""
    return {"adapter_rank": int(rank), "adapter_alpha": float(alpha), "adapter_target_modules": sorted(target_modules)}


def update_hf_dir(update: dict) -> str:
    """The HF model directory a WeightUpdate names in its metadata ('' when it names none)."""
    return (update.get("metadata") or {}).get(HF_DIR_KEY) or ""


# ---- a multi-turn environment's reward (Trajectory metadata) -----------------------------------
ENV_REWARD_KEY = "env_reward"
"""Trajectory metadata key of the sum of the rewards a multi-turn environment returned for its turns."""


def format_env_reward(reward: float) -> str:
    """The metadata value of an environment reward (exact: ``repr`` of the float)."""
    return repr(float(reward))


def env_reward_text(trajectory: dict) -> str | None:
    """The environment reward a trajectory carries, as written (None: it carries none); ``float``
    reads it back."""
    return (trajectory.get("metadata") or {}).get(ENV_REWARD_KEY)


# ---- a demonstration (Trajectory metadata) ------------------------------------------------------
DEMO_KEY = "demonstration"
"""Trajectory metadata key, ``"1"`` on a supervised demonstration (the feed's ``sft`` mode,
``producers.sft``): no policy version generated it, so the trainer's staleness bound does not
apply to it (its ``version_min``/``version_max`` are 0)."""


def is_demonstration(trajectory: dict) -> bool:
    """Whether a trajectory is a supervised demonstration rather than a policy's sample."""
    return (trajectory.get("metadata") or {}).get(DEMO_KEY) == "1"


# ---- an over-provisioned group's draw (Trajectory metadata) -------------------------------------
DRAW_KEY = "drawn_as"
"""Trajectory metadata key, ``rollout.overprovision`` only: the index the sample was drawn under,
among the ``group_size`` + extra started for its group (its ``sample_index`` is its place among the
first ``group_size`` to finish)."""

QUORUM_KEY = "quorum"
"""Trajectory metadata key, ``rollout.overprovision_tail = "train"`` only: how many of the group's
``group_size`` samples (its first to finish) close it for training; the others are its tail,
trained later with the baseline of the samples already trained (consumers/trainer/assembler.py)."""


def group_quorum(trajectory: dict) -> int:
    """The quorum a trajectory carries (0: none, the whole group closes it); ``InvalidRecord`` if it
    is not an integer in ``[1, group_size]``."""
    text = (trajectory.get("metadata") or {}).get(QUORUM_KEY)
    if text is None:
        return 0
    try:
        q = int(text)
    except ValueError:
        raise InvalidRecord(
            f"{trajectory['trajectory_id']}: metadata {QUORUM_KEY}={text!r} is not an integer"
        ) from None
    if not 1 <= q <= int(trajectory["group_size"]):
        raise InvalidRecord(
            f"{trajectory['trajectory_id']}: metadata {QUORUM_KEY}={q} outside [1, group_size {trajectory['group_size']}]"
        )
    return q


# ---- per-token version marks (Trajectory / ScoredTrajectory metadata) --------------------------
VERSIONS_KEY = "versions"
"""The metadata key of a sample's per-token version marks."""


def format_version_marks(marks) -> str:
    """``"i@v,..."``: policy version ``v`` generated the response from token ``i`` on (written by the
    rollout worker, ``producers.sample``, when a sample spans weight updates)."""
    return ",".join(f"{i}@{v}" for i, v in marks)


def split_version_marks(text: str | None) -> list[tuple[int, int]]:
    """The ``(index, version)`` pairs of ``format_version_marks``'s text (``[]`` for none), checked
    for their form only; InvalidRecord when it is not ``index@version,...``. What the pairs must
    satisfy against a record is the trainer's check (``consumers.trainer.staleness.parse_marks``)."""
    if not text:
        return []
    pairs = []
    for part in text.split(","):
        i, sep, v = part.strip().partition("@")
        try:
            if not sep:
                raise ValueError(part)
            pairs.append((int(i), int(v)))
        except ValueError:
            raise InvalidRecord(f"metadata versions {text[:80]!r} is not 'index@version,...'") from None
    return pairs


def _text(rec: dict, *fields: str) -> None:
    for f in fields:
        if len(rec.get(f) or "") > MAX_TEXT_CHARS:
            raise InvalidRecord(f"{f} has {len(rec[f])} characters, more than {MAX_TEXT_CHARS}", "too_long")


def check_prompt(p: dict) -> None:
    """A Prompt the rollout worker can generate for."""
    n, start, count = p["group_size"], p["sample_start"], p["sample_count"]
    if n < 1:
        raise InvalidRecord(f"group_size {n} < 1")
    if count < 1 or start < 0 or start + count > n:
        raise InvalidRecord(f"samples [{start}, {start + count}) do not fit group_size {n}")
    if p["group_seq"] < -1:
        raise InvalidRecord(f"group_seq {p['group_seq']} is negative (only -1, unnumbered, is allowed)")
    if p["max_new_tokens"] is not None and p["max_new_tokens"] <= 0:
        raise InvalidRecord(f"max_new_tokens {p['max_new_tokens']} <= 0")
    if not p["text"] and not p.get("messages"):
        raise InvalidRecord("empty prompt text and no messages")
    if not p["group_id"] or not p["task"]:
        raise InvalidRecord("empty group_id or task")
    _text(p, "text", "reference", "messages")


def _packed(t: dict, field: str, dtype: str, tid: str) -> np.ndarray:
    """A packed little-endian array field as a read-only numpy view of the record's bytes."""
    data = t[field]
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise InvalidRecord(f"{tid}: {field} has {len(data)} bytes, not a multiple of {size}")
    return np.frombuffer(data, dtype=dtype)


def check_trajectory(t: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A Trajectory that can be scored and trained; returns its unpacked (prompt tokens, response
    tokens, logprobs, loss mask) as numpy arrays (int32, int32, float32, uint8): read-only views of
    the record's bytes where the wire format allows, so no per-token Python runs (this is called
    once per record in the reward and the trainer stage)."""
    tid = t["trajectory_id"]
    if not tid or not t["group_id"]:
        raise InvalidRecord("empty trajectory_id or group_id")
    if t["group_size"] < 1 or not 0 <= t["sample_index"] < t["group_size"]:
        raise InvalidRecord(f"{tid}: sample_index {t['sample_index']} outside group_size {t['group_size']}")
    if t["group_seq"] < -1:
        raise InvalidRecord(f"{tid}: group_seq {t['group_seq']} is negative")
    if t["version_min"] < 0 or t["version_max"] < t["version_min"]:
        raise InvalidRecord(f"{tid}: versions [{t['version_min']}, {t['version_max']}] are not 0 <= min <= max")
    _text(t, "prompt_text", "response_text", "reference")
    prompt = _packed(t, "prompt_tokens", "<i4", tid)
    response = _packed(t, "response_tokens", "<i4", tid)
    logprobs = _packed(t, "logprobs", "<f4", tid)
    if not len(prompt) or not len(response):
        raise InvalidRecord(f"{tid}: empty prompt or response tokens")
    if len(prompt) + len(response) > MAX_TOKENS:
        raise InvalidRecord(f"{tid}: {len(prompt) + len(response)} tokens, more than {MAX_TOKENS}", "too_long")
    if prompt.min() < 0 or response.min() < 0:
        raise InvalidRecord(f"{tid}: negative token id")
    if len(logprobs) != len(response):
        raise InvalidRecord(f"{tid}: {len(logprobs)} logprobs for {len(response)} response tokens")
    if not (np.isfinite(logprobs).all() and (logprobs <= 1e-3).all()):
        raise InvalidRecord(f"{tid}: logprobs must be finite and <= 0")
    raw_mask = t["loss_mask"]
    if raw_mask:
        mask = np.frombuffer(raw_mask, dtype=np.uint8)
        if len(mask) != len(response) or int(mask.max()) > 1:
            raise InvalidRecord(f"{tid}: loss_mask must hold one 0/1 per response token")
    else:
        mask = np.ones(len(response), dtype=np.uint8)
    return prompt, response, logprobs, mask


def check_scored(rec: dict, vocab_size: int | None = None, max_len: int | None = None):
    """A ScoredTrajectory the trainer can use: a valid trajectory, a finite reward, and (when the
    trainer passes them) token ids below ``vocab_size`` and a length within ``max_len``."""
    if not isinstance(rec.get("trajectory"), dict):
        raise InvalidRecord("scored record without a trajectory")
    prompt, response, logprobs, mask = check_trajectory(rec["trajectory"])
    tid = rec["trajectory"]["trajectory_id"]
    if not math.isfinite(rec["reward"]):
        raise InvalidRecord(f"{tid}: reward {rec['reward']} is not finite")
    if vocab_size is not None and (top := max(int(prompt.max()), int(response.max()))) >= vocab_size:
        raise InvalidRecord(f"{tid}: token id {top} outside the vocabulary ({vocab_size})")
    if max_len is not None and len(prompt) + len(response) > max_len:
        raise InvalidRecord(f"{tid}: {len(prompt) + len(response)} tokens, more than the model's {max_len}", "too_long")
    return prompt, response, logprobs, mask


# ---- the trainer's per-step staleness gauges (MetricEvent metrics) ----------------------------
LAG_PREFIX = "version_lag_"
"""A trainer step's MetricEvent counts its trained samples by version lag: ``version_lag_<d>``."""


def lag_gauges(counts: dict[int, int]) -> dict[str, int]:
    """The gauges of a step that trained ``counts[d]`` samples ``d`` versions behind."""
    return {f"{LAG_PREFIX}{d}": n for d, n in counts.items()}


def lag_counts(metrics: dict) -> dict[str, int]:
    """lag (as the text after the prefix) -> samples, read back from a step's metrics."""
    return {k.removeprefix(LAG_PREFIX): int(v) for k, v in metrics.items() if k.startswith(LAG_PREFIX)}


def step_samples(metrics: dict) -> int:
    """Samples a trainer step event's step trained: the sum of its ``version_lag_<d>`` counts."""
    return sum(lag_counts(metrics).values())


def dead_letter(msg, error_type: str, reason: str, role: str, worker_id: str) -> dict:
    """The DeadLetter record of consumed message ``msg``: its bytes, where it came from, and why."""
    return {
        "source_topic": msg.topic(),
        "source_partition": msg.partition(),
        "source_offset": msg.offset(),
        "key": msg.key(),
        "value": msg.value(),
        "headers": {k: (v or b"") for k, v in (msg.headers() or [])},
        "error_type": error_type,
        "reason": reason,
        "role": role,
        "worker_id": worker_id,
        "failed_at_ms": int(time.time() * 1000),
    }
