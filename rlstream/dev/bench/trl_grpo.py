"""Hugging Face TRL's ``GRPOTrainer`` as a child process, shared by the peer benchmarks
(``rlstream bench trl``: the real-model recipe; ``rlstream bench peer``: examples/next-digit.toml).

The parent side writes a spec (a JSON file of the matched settings: model directory, train and
held-out records, the reward config, group size, prompts per step, optimizer, sampling), starts
``train`` in a fresh interpreter and reads back what it wrote: the held-out eval curve (when the spec
has an eval set), one entry per optimizer step (wall-clock time and the batch's mean reward), and the
digest of the weights TRL started from beside the digest of the same directory as rlstream's loader
reads it. CPU time is the parent's ``getrusage(RUSAGE_CHILDREN)`` delta around the child.

Matching, as both benchmarks use it: ``per_device_train_batch_size = group_size * groups_per_step``
with one generation batch per optimizer step (``steps_per_generation = 1``, ``num_iterations = 1``),
loss ``dapo`` (rlstream's ``ppo_clip`` with ``token-mean``) with ``beta = 0``, GRPO advantages
(group mean and std), the recipe's learning rate, warm-up, AdamW settings, gradient clipping, max new
tokens and temperature (top-k and top-p off), the reward through the project's own ``TaskRouter``.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from rlstream.dev.bench.harness import child_env, cpu_children, write_json


def require_trl(bench: str) -> None:
    """Fail with the install line when TRL is not importable (the ``peer`` extra)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        from pipeline.errors import ConfigError

        raise ConfigError(
            f"rlstream bench {bench} needs TRL: pip install trl==1.16.0 (or the peer extra: pip install -e '.[peer]')"
        )


def run_child(spec: dict, timeout_s: float) -> dict:
    """Write ``spec``, run ``train`` on it in a child process; returns what the child wrote plus
    ``returncode``, ``t_start`` (epoch seconds just before the process started), ``wall_s`` and
    ``cpu_s`` (the child's CPU seconds). The child's output is in ``<work_dir>/trl.out``."""
    work = Path(spec["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    spec_path = write_json(work / "spec.json", spec)
    code = f"from rlstream.dev.bench.trl_grpo import train; train({str(spec_path)!r})"
    cpu0, t0 = cpu_children(), time.time()
    with open(work / "trl.out", "w") as log:
        try:
            rc = subprocess.run([sys.executable, "-c", code], env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                timeout=timeout_s).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall, cpu = time.time() - t0, cpu_children() - cpu0
    out = Path(spec["out"])
    got = json.loads(out.read_text()) if out.is_file() else {"curve": [], "steps": 0, "step_log": []}
    return {**got, "returncode": rc, "t_start": t0, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def state_digest(model) -> str:
    """sha256 over the parameter names and their float32 bytes, in name order: the same weights
    give the same digest whichever loader built the module."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ---- inside the TRL process ---------------------------------------------------------------------
def _rows(path: str) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def _prompt(rec: dict):
    """Chat messages (TRL's conversational format) or plain prompt text, as the feed would send it."""
    return rec["messages"] if "messages" in rec else rec["prompt"]


def _text(tok, rec: dict) -> str:
    if "messages" in rec:
        return tok.apply_chat_template(rec["messages"], tokenize=False, add_generation_prompt=True)
    return rec["prompt"]


def grpo_args(spec: dict):
    """TRL's ``GRPOConfig`` from the spec's matched settings."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=spec["work_dir"], use_cpu=True, bf16=spec["bf16"], seed=spec["seed"],
        learning_rate=spec["lr"], lr_scheduler_type="constant_with_warmup", warmup_steps=spec["warmup_steps"],
        max_grad_norm=spec["grad_clip"] or 1e9, adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        adam_epsilon=spec["eps"], weight_decay=spec["weight_decay"],
        per_device_train_batch_size=spec["group_size"] * spec["groups_per_step"], gradient_accumulation_steps=1,
        num_generations=spec["group_size"], num_iterations=1, max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"], top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
        max_steps=spec.get("max_steps") or 1_000_000, logging_steps=10, save_strategy="no", report_to="none",
        dataloader_num_workers=0,
    )  # fmt: skip


def train(spec_path: str) -> None:
    """Run TRL's GRPOTrainer on the spec and write its eval curve and per-step log to ``spec["out"]``.
    Stops at ``max_steps`` or when ``budget_s`` of training time (evals excluded) is spent."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from consumers.reward.config import RewardConfig
    from libs.rewards.base import TaskRouter

    router = TaskRouter(RewardConfig.model_validate(spec["reward"]))
    rows = _rows(spec["train"])
    if spec.get("max_steps"):  # a small task (next-digit has 10 prompts): one long epoch, not hundreds
        rows = rows * -(-spec["max_steps"] * spec["groups_per_step"] // len(rows))
    ds = Dataset.from_list([{"prompt": _prompt(r), "reference": json.dumps(r.get("reference", {})),
                             "task": r.get("task", "")} for r in rows])  # fmt: skip
    state = {"t0": time.monotonic(), "paused": 0.0, "curve": [], "eval_s": 0.0, "steps": 0, "step_log": []}
    pending: list[float] = []

    def reward(prompts, completions, reference, task, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        out = [router({"response_text": t, "reference": ref, "task": tk}).reward
               for t, ref, tk in zip(texts, reference, task, strict=True)]  # fmt: skip
        pending.extend(out)
        return out

    held = _rows(spec["eval"])[: spec["eval_prompts"] or None] if spec.get("eval") else []
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"

    def clock() -> float:
        return time.monotonic() - state["t0"] - state["paused"]

    def save() -> None:
        Path(spec["out"]).write_text(json.dumps({**state, "t0": None}))

    def evaluate(model, step: int) -> None:
        t, now = time.monotonic(), clock()
        texts = [_text(tok, r) for r in held]
        enc = tok(texts, return_tensors="pt", padding=True).to(model.device)
        was_training = model.training
        model.eval()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec["bf16"]):
            out = model.generate(**enc, max_new_tokens=spec["eval_max_new_tokens"], do_sample=False,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        model.train(was_training)
        answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        scores = [router({"response_text": a, "reference": json.dumps(r.get("reference", {})),
                          "task": r.get("task", "")}).reward for a, r in zip(answers, held, strict=True)]  # fmt: skip
        n = step * spec["group_size"] * spec["groups_per_step"]
        state["curve"].append({"version": step, "pass_at_1": round(sum(s >= 1.0 for s in scores) / len(scores), 4),
                               "reward_mean": round(sum(scores) / len(scores), 4), "wall_s": round(now, 1),
                               "samples": n})  # fmt: skip
        spent = time.monotonic() - t
        state["paused"] += spent
        state["eval_s"] += spent
        print(f"[trl] step {step} eval pass@1 {state['curve'][-1]['pass_at_1']} at {now:.0f} s", flush=True)
        save()

    class Clock(TrainerCallback):
        def on_train_begin(self, args, st, control, model=None, **kw):
            if spec.get("check_weights"):  # what TRL loaded against what rlstream's loader reads
                from pipeline.models import load_model

                state["weights_digest"] = state_digest(model)
                state["weights_digest_rlstream_loader"] = state_digest(load_model(Path(spec["model_dir"])))
            state["t_train_begin"] = time.time()
            state["t0"] = time.monotonic()
            if held:
                evaluate(model, 0)

        def on_step_end(self, args, st, control, model=None, **kw):
            state["steps"] = st.global_step
            batch = list(pending)
            pending.clear()
            state["step_log"].append({"step": st.global_step, "time": time.time(), "samples": len(batch),
                                      "reward_mean": sum(batch) / len(batch) if batch else None})  # fmt: skip
            if held and st.global_step % spec["eval_every"] == 0:
                evaluate(model, st.global_step)
            if spec.get("budget_s") and clock() >= spec["budget_s"]:
                control.should_training_stop = True

    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=reward, args=grpo_args(spec), train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    state["steps"] = trainer.state.global_step
    if held and (not state["curve"] or state["curve"][-1]["version"] != state["steps"]):
        evaluate(trainer.model, state["steps"])
    save()
