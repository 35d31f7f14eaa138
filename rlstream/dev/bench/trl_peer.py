"""``rlstream bench trl``: the real-model recipe in Hugging Face TRL's ``GRPOTrainer`` beside rlstream,
on the same machine, run in turn (TRL, rlstream, TRL, ... with ``repeats``), each for the same
wall-clock budget: the peer users would otherwise use on one machine.

Matched from the recipe's resolved config: the model directory (the same imported weights), the
generated train and held-out records (chat messages, the same reference), the reward (the recipe's
``reward.tasks`` through the project's own ``TaskRouter``), group size (``num_generations``), prompts
per optimizer step (``per_device_train_batch_size = group_size * groups_per_step``, one optimizer
step per generation batch, ``num_iterations = 1``), learning rate with the same warm-up and a constant
schedule, gradient clipping, AdamW betas/eps/weight decay, max new tokens, temperature (top-k and
top-p off), bf16 autocast when the recipe's trainer uses it, and the held-out eval (greedy pass@1 on
the same prompts every ``eval.every_versions`` optimizer steps).

Semantic differences, stated because they are not removable: TRL is synchronous (generation, then
the update, in one process: rlstream's k = 0 without Kafka); its loss is ``dapo`` (token-level
clipped surrogate normalised over the batch's tokens, which is rlstream's ``ppo_clip`` with
``token-mean`` aggregation) with ``beta = 0`` (no KL, as the recipe); its advantages are GRPO's
(group mean and std); its generation is ``transformers.generate`` with the whole batch padded, while
rlstream's hf engine batches continuously. TRL's eval pauses its training clock (it runs inline);
rlstream's eval runs as a process of its own and shares the two cores.

Per run it reports wall time to ``v0 + target_gain`` held-out pass@1, the final and best pass@1,
optimizer steps, samples trained, and samples per CPU-second (all processes of the run, from
``getrusage(RUSAGE_CHILDREN)``). It prints figures and asserts nothing.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from pipeline.models import resolve_dtype
from rlstream.dev.bench import learn
from rlstream.dev.bench.harness import REPO, BenchContext, child_env, md_table, write_json

SIZES = {
    "tiny": {"recipe": learn.SIZES["tiny"]["recipe"], "budget_s": 60, "repeats": 1, "k": 1,
             "sets": learn.SIZES["tiny"]["sets"], "target_gain": 0.2},
    "full": {"recipe": learn.SIZES["full"]["recipe"], "budget_s": 3600, "repeats": 1, "k": 1, "sets": [],
             "target_gain": 0.2},
}  # fmt: skip


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def trl_spec(ctx: BenchContext, name: str, sz: dict) -> dict:
    """What the TRL run needs, taken from the recipe's resolved config."""
    from pipeline.models import materialize
    from rlstream.job import resolve

    sets = [*ctx.base_sets, *sz["sets"], f"job.name={name}", f"run_dir={json.dumps(str(ctx.out / 'trl'))}"]
    cfg = resolve(sz["recipe"], sets, bootstrap="unused:1")
    t, o = cfg.trainer, cfg.trainer.optim
    return {
        "model_dir": str(materialize(cfg.model)),
        "train": str(cfg.feed.source),
        "eval": str(cfg.eval.source),
        "reward": cfg.reward.model_dump(mode="json"),
        "group_size": cfg.rl.group_size,
        "groups_per_step": cfg.rl.groups_per_step,
        "lr": t.lr,
        "warmup_steps": o.warmup_steps,
        "grad_clip": o.grad_clip,
        "betas": list(o.betas),
        "eps": o.eps,
        "weight_decay": o.weight_decay,
        "bf16": resolve_dtype(getattr(t.engine, "dtype", "float32"), "cpu") == "bfloat16",
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "eval_every": cfg.eval.every_versions,
        "eval_prompts": cfg.eval.max_prompts,
        "eval_max_new_tokens": cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
        "seed": t.seed,
        "budget_s": sz["budget_s"],
        "threads": os.cpu_count() or 1,
        "out": str(ctx.out / "trl" / f"{name}.json"),
        "work_dir": str(ctx.out / "trl" / name),
    }


def run_trl(ctx: BenchContext, name: str, sz: dict) -> dict:
    spec = trl_spec(ctx, name, sz)
    Path(spec["work_dir"]).mkdir(parents=True, exist_ok=True)
    spec_path = Path(spec["work_dir"]) / "spec.json"
    write_json(spec_path, spec)
    ctx.say(f"[bench] trl {name}: budget {sz['budget_s']} s")
    cpu0, load0, t0 = _cpu_children(), os.getloadavg()[0], time.time()
    code = f"from rlstream.dev.bench.trl_peer import train; train({str(spec_path)!r})"
    with open(Path(spec["work_dir"]) / "trl.out", "w") as log:
        proc = subprocess.run([sys.executable, "-c", code], env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                              timeout=sz["budget_s"] * 2 + 600)  # fmt: skip
    got = json.loads(Path(spec["out"]).read_text()) if Path(spec["out"]).is_file() else {"curve": [], "steps": 0}
    res = learn.summarize(got["curve"], [], sz["target_gain"])
    samples = got["steps"] * spec["group_size"] * spec["groups_per_step"]
    cpu = _cpu_children() - cpu0
    return {**res, "engine": "trl", "name": name, "status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}",
            "wall_s": round(time.time() - t0, 1), "steps": got["steps"], "samples_trained": samples,
            "cpu_s": round(cpu, 1), "samples_per_cpu_s": round(samples / cpu, 3) if cpu else None,
            "eval_s": got.get("eval_s"), "curve": got["curve"], "loadavg_at_start": round(load0, 2)}  # fmt: skip


def run_rlstream(ctx: BenchContext, name: str, sz: dict) -> dict:
    cpu0 = _cpu_children()
    r = learn.run_one(ctx, name, sz["k"], {**learn.SIZES[ctx.size], **sz, "steps": 100_000})
    cpu = _cpu_children() - cpu0
    return {**r, "engine": f"rlstream k={sz['k']}", "cpu_s": round(cpu, 1),
            "samples_per_cpu_s": round(r["samples_trained"] / cpu, 3) if cpu else None}  # fmt: skip


def run(ctx: BenchContext) -> dict:
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        from pipeline.errors import ConfigError

        raise ConfigError(
            "rlstream bench trl needs TRL: pip install trl==1.16.0 (or the peer extra: pip install -e '.[peer]')"
        )
    sz = {**SIZES[ctx.size], **({"budget_s": ctx.extra["budget_s"]} if ctx.extra.get("budget_s") else {})}
    runs = []
    for r in range(sz["repeats"]):
        for which in ("trl", "rlstream") if r % 2 == 0 else ("rlstream", "trl"):
            name = f"peer-{ctx.run_id}-{which}-r{r}"
            runs.append(run_trl(ctx, name, sz) if which == "trl" else run_rlstream(ctx, name, sz))
            write_json(ctx.out / "trl.json", {"benchmark": "trl", "runs": runs})
    result = {"benchmark": "trl", "size": ctx.size, "recipe": str(sz["recipe"].relative_to(REPO)),
              "budget_s": sz["budget_s"], "target_gain": sz["target_gain"], "runs": runs}  # fmt: skip
    write_json(ctx.out / "trl.json", result)
    return result


def table(result: dict) -> str:
    return md_table(
        ["engine", "status", "steps", "samples", "samples / CPU-s", "pass@1 v0", "final (version)", "best",
         f"time to v0 + {result['target_gain']:g}", "load avg at start"],
        [[r["engine"], r["status"], r["steps"], r["samples_trained"], r["samples_per_cpu_s"], r["pass_at_1_v0"],
          f"{r['pass_at_1_final']} (v{r['final_version']})", r["pass_at_1_best"],
          "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f} s", r["loadavg_at_start"]]
         for r in result["runs"]],
    )  # fmt: skip


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


def train(spec_path: str) -> None:
    """Run TRL's GRPOTrainer on the spec (the recipe's settings) and write its eval curve."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from consumers.reward.config import RewardConfig
    from libs.rewards.base import TaskRouter

    router = TaskRouter(RewardConfig.model_validate(spec["reward"]))
    train_rows = _rows(spec["train"])
    ds = Dataset.from_list([{"prompt": _prompt(r), "reference": json.dumps(r.get("reference", {})),
                             "task": r.get("task", "")} for r in train_rows])  # fmt: skip

    def reward(prompts, completions, reference, task, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [router({"response_text": t, "reference": ref, "task": tk}).reward
                for t, ref, tk in zip(texts, reference, task, strict=True)]  # fmt: skip

    held = _rows(spec["eval"])[: spec["eval_prompts"] or None]
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"
    state = {"t0": time.monotonic(), "paused": 0.0, "curve": [], "eval_s": 0.0, "steps": 0}

    def clock() -> float:
        return time.monotonic() - state["t0"] - state["paused"]

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
        Path(spec["out"]).write_text(json.dumps({**state, "t0": None}))

    class Clock(TrainerCallback):
        def on_train_begin(self, args, st, control, model=None, **kw):
            state["t0"] = time.monotonic()
            evaluate(model, 0)

        def on_step_end(self, args, st, control, model=None, **kw):
            state["steps"] = st.global_step
            if st.global_step % spec["eval_every"] == 0:
                evaluate(model, st.global_step)
            if clock() >= spec["budget_s"]:
                control.should_training_stop = True

    batch = spec["group_size"] * spec["groups_per_step"]
    args = GRPOConfig(
        output_dir=spec["work_dir"], use_cpu=True, bf16=spec["bf16"], seed=spec["seed"],
        learning_rate=spec["lr"], lr_scheduler_type="constant_with_warmup", warmup_steps=spec["warmup_steps"],
        max_grad_norm=spec["grad_clip"] or 1e9, adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        adam_epsilon=spec["eps"], weight_decay=spec["weight_decay"],
        per_device_train_batch_size=batch, gradient_accumulation_steps=1, num_generations=spec["group_size"],
        num_iterations=1, max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
        top_k=0, top_p=1.0, beta=0.0, loss_type="dapo", scale_rewards="group", max_steps=1_000_000,
        logging_steps=10, save_strategy="no", report_to="none", dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=reward, args=args, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])  # fmt: skip
    trainer.train()
    state["steps"] = trainer.state.global_step
    if not state["curve"] or state["curve"][-1]["version"] != state["steps"]:
        evaluate(trainer.model, state["steps"])
    Path(spec["out"]).write_text(json.dumps({**state, "t0": None}))
