"""Trainer figures on this machine for the tiny model: optimizer steps/s, and the latency of the
per-step checkpoint path -- writing the safetensors weights, the trainer checkpoint (engine state
+ pointer), and publishing the WeightUpdate on rl.control.

    python -m rlstream.dev.bench.trainer_steps [--steps 30] [--engine torch|deepspeed] [--bootstrap HOST:PORT]

Uses ``--bootstrap`` or ``KAFKA_BOOTSTRAP`` if given, else starts a local broker (as the tests do)
and stops it at the end. All scored records are produced first, so the trainer is never waiting
for data; it runs in-process with ``publish_every = 1`` (a checkpoint and a notice every step).
Timings come from wrapping the trainer's own calls. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import tempfile
import time

from pipeline import codec
from pipeline.admin import ensure_topics
from pipeline.kafka import Producer, client_conf
from rlstream.dev.bench.harness import scratch_config


def scored_record(gid: str, idx: int, size: int, rng: random.Random, prompt: int, response: int) -> dict:
    return {
        "trajectory": {
            "trajectory_id": f"{gid}/{idx}",
            "group_id": gid,
            "prompt_id": gid,
            "sample_index": idx,
            "group_size": size,
            "task": "bench",
            "prompt_text": "",
            "response_text": "",
            "prompt_tokens": codec.pack_i32([rng.randrange(4, 90) for _ in range(prompt)]),
            "response_tokens": codec.pack_i32([rng.randrange(4, 90) for _ in range(response)]),
            "logprobs": codec.pack_f32([-rng.uniform(3.5, 5.0) for _ in range(response)]),
            "loss_mask": b"",  # all ones
            "finish_reason": "stop",
            "version_min": 0,
            "version_max": 0,
            "worker_id": "bench",
        },
        "reward": float(rng.random() < 0.5),
        "scorer_id": "bench",
        "scored_at_ms": 1,
    }


def timed(store: dict, name: str, fn):
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            store.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)

    return wrapper


def summary(xs: list[float]) -> dict:
    s = sorted(xs)
    return {
        "n": len(s),
        "mean": round(statistics.fmean(s), 2),
        "p50": round(s[len(s) // 2], 2),
        "p90": round(s[min(len(s) - 1, int(len(s) * 0.9))], 2),
        "max": round(s[-1], 2),
    }


def run(bootstrap: str, steps: int, engine: str, prompt: int, response: int, run_dir: str) -> dict:
    from consumers.trainer import worker
    from consumers.trainer.state import read_steps_log

    cfg = scratch_config(
        bootstrap,
        run_dir,
        {
            "model.type": "tiny",  # the default tiny Llama: hidden 128, 2 layers
            "rl.max_staleness": 1000,
            "trainer.engine.type": engine,
            "trainer.micro_batch_size": 32,
            "trainer.poll_timeout_s": 0.05,
            "trainer.metrics_interval_s": 60,
        },
    )
    ensure_topics(cfg, ["scored", "control", "metrics", "dlq"])
    n, g = cfg.rl.group_size, cfg.rl.groups_per_step
    rng = random.Random(0)
    with Producer(client_conf(cfg, "bench", kind="producer")) as p:
        for i in range(steps * g):
            for j in range(n):
                rec = scored_record(f"b{i:05d}", j, n, rng, prompt, response)
                p.produce_record(cfg.topics.name("scored"), "ScoredTrajectory", rec, key=f"b{i:05d}".encode())

    t: dict[str, list[float]] = {}
    worker.write_weights = timed(t, "write_weights_ms", worker.write_weights)
    worker.publish_weight_update = timed(t, "publish_ms", worker.publish_weight_update)
    trainer = worker.Trainer(cfg, max_steps=steps)
    trainer.start()  # set up now, so its engine can be timed
    trainer.engine.save = timed(t, "engine_save_ms", trainer.engine.save)
    trainer.ckpts.write_pointer = timed(t, "pointer_ms", trainer.ckpts.write_pointer)
    trainer.engine.train_step = timed(t, "optimizer_step_ms", trainer.engine.train_step)
    t0 = time.perf_counter()
    try:
        trainer.run()
    finally:
        trainer.close()
    wall = time.perf_counter() - t0
    log = read_steps_log(trainer.root)
    first, last = log[0]["time"] - log[0]["step_time_s"], log[-1]["time"]
    steady = len(log) / (last - first)
    ckpt_total = [
        a + b + c for a, b, c in zip(t["write_weights_ms"], t["engine_save_ms"], t["pointer_ms"], strict=True)
    ]
    return {
        "engine": engine,
        "steps": len(log),
        "samples_per_step": n * g,
        "tokens_per_sample": prompt + response,
        "params": sum(v.numel() for v in trainer.engine.state_dict().values()),
        "weights_bytes": trainer.ckpts.read_pointer()["update"]["bytes"],
        "optimizer_steps_per_s_with_ckpt_and_publish": round(steady, 2),
        "optimizer_steps_per_s_compute_only": round(1e3 / statistics.fmean(t["optimizer_step_ms"]), 2),
        "wall_s_including_startup": round(wall, 2),
        "optimizer_step_ms": summary(t["optimizer_step_ms"]),
        "write_weights_ms": summary(t["write_weights_ms"]),
        "engine_checkpoint_ms": summary(t["engine_save_ms"]),
        "pointer_ms": summary(t["pointer_ms"]),
        "checkpoint_total_ms": summary(ckpt_total),
        "publish_ms": summary(t["publish_ms"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--engine", choices=["torch", "deepspeed"], default="torch")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--response-tokens", type=int, default=48)
    ap.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP"))
    args = ap.parse_args()
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap
        if not bootstrap:
            from rlstream.dev.bench.harness import broker

            bootstrap, _pid = stack.enter_context(broker(None))
        run_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rlstream-bench-trainer-"))
        result = run(bootstrap, args.steps, args.engine, args.prompt_tokens, args.response_tokens, run_dir)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
