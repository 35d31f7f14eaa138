"""Reward-worker throughput on this machine: trajectories/s of ONE worker (exactly-once loop
included: decode, score, produce, send offsets, commit) for a trivial reward (exact match), the
math verifier (math-verify) and, with --code, the code sandbox.

    python -m rlstream.dev.bench.reward_throughput [--n 3000] [--n-math 1500] [--code 60] [--bootstrap HOST:PORT]

Uses ``--bootstrap`` or ``KAFKA_BOOTSTRAP`` if given, else starts a local broker (as the tests do)
and stops it at the end. Each case gets its own topics; the rollouts are produced first, then one
worker runs in-process and the rate is measured from its first consumed message to its last
commit. It prints figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading

from consumers.reward.worker import RewardWorker
from pipeline import codec
from pipeline.admin import Admin, ensure_topics
from pipeline.kafka import Producer, client_conf, wait_for
from rlstream.dev.bench.harness import broker, scratch_config
from rlstream.dev.bench.transport import trajectories


def _math_item(i: int, rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(1, 9), rng.choice([2, 4, 5, 8, 10])
    forms = [f"\\frac{{{a}}}{{{b}}}", f"{a}/{b}", f"{a / b:g}"]
    gold, said = rng.choice(forms), rng.choice(forms)
    if i % 4 == 0:
        said = f"{a + 1}/{b}"  # a wrong answer now and then
    return gold, f"We compute step by step. Therefore the answer is $\\boxed{{{said}}}$."


def _code_item(i: int) -> tuple[str, str]:
    tests = {"tests": [{"input": f"{k}\n", "output": f"{k * k}\n"} for k in (2, 3)]}
    prog = "n = int(input())\nprint(n * n)\n" if i % 2 else "print(4)\n"
    return json.dumps(tests), f"```python\n{prog}```"


def produce(cfg, kind: str, n: int) -> None:
    rng = random.Random(0)
    with Producer(client_conf(cfg, "bench", kind="producer")) as p:
        for i, t in enumerate(trajectories(n, 256, 256)):
            group = t["group_id"]
            t.update(task=kind, response_text="abc", reference=json.dumps({"answer": "abc"}))
            if kind == "math":
                gold, t["response_text"] = _math_item(i, rng)
                t["reference"] = json.dumps({"answer": gold})
            elif kind == "code":
                t["reference"], t["response_text"] = _code_item(i)
            p.produce(cfg.topics.name("rollouts"), codec.encode("Trajectory", t), key=group.encode())


def run_case(bootstrap: str, name: str, kind: str, n: int, sets: dict, run_dir: str) -> dict:
    cfg = scratch_config(
        bootstrap,
        run_dir,
        {
            "reward.tasks": {"copy": [{"name": "exact_match"}], "math": [{"name": "math"}], "code": [{"name": "code"}]},
            "reward.max_batch_size": 64,
            "reward.timeout_s": 5,
            "reward.max_batch_ms": 100,
            **sets,
        },
    )
    ensure_topics(cfg, ["rollouts", "scored", "dlq", "metrics"])
    produce(cfg, kind, n)
    worker = RewardWorker(cfg)
    t = threading.Thread(target=worker.run, daemon=True)
    t.start()
    ok = wait_for(lambda: worker.metrics is not None and worker.metrics.counters.get("consumed", 0) >= n, 1800, 0.2)
    worker.stop()
    t.join(120)
    m = worker.metrics
    elapsed = (m.last_commit_at or 0) - (m.first_message_at or 0)
    lag = Admin(client_conf(cfg, "bench")).lag(cfg.reward.group_id, cfg.topics.name("rollouts"))
    return {
        "case": name,
        "trajectories": int(m.counters.get("consumed", 0)),
        "complete": ok and not any(lag.values()),
        "seconds": round(elapsed, 2),
        "trajectories_per_s": round(m.counters.get("consumed", 0) / elapsed, 1) if elapsed > 0 else None,
        "mean_reward": round(m.m.gauges.get(f"task.{kind}.reward_mean", float("nan")), 3),
        "transactions": int(m.counters.get("transactions", 0)),
        "dlq": int(m.counters.get("dead_letters", 0)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3000, help="trajectories for the trivial reward")
    ap.add_argument("--n-math", type=int, default=1500, help="trajectories for the math verifier")
    ap.add_argument("--code", type=int, default=60, help="trajectories for the code sandbox (0 = skip)")
    ap.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP"))
    args = ap.parse_args()
    cases = [
        ("exact_match, thread x1", "copy", args.n, {"reward.executor": "thread", "reward.pool_size": 1}),
        ("exact_match, process x1", "copy", args.n, {"reward.executor": "process", "reward.pool_size": 1}),
        ("math-verify, process x1", "math", args.n_math, {"reward.executor": "process", "reward.pool_size": 1}),
        ("math-verify, process x2", "math", args.n_math, {"reward.executor": "process", "reward.pool_size": 2}),
    ]
    if args.code:
        cases.append(("code sandbox (2 tests), process x2", "code", args.code, ["reward.pool_size=2"]))
    results = []
    with broker(args.bootstrap) as (bs, _pid), tempfile.TemporaryDirectory() as run_dir:
        print(f"broker {bs}; {os.cpu_count()} CPU(s); one reward worker per case")
        for name, kind, n, sets in cases:
            res = run_case(bs, name, kind, n, sets, run_dir)
            results.append(res)
            print(json.dumps(res), flush=True)
    print(f"\n{'case':<38}{'traj/s':>10}{'n':>8}{'s':>8}{'reward':>8}")
    for r in results:
        print(
            f"{r['case']:<38}{r['trajectories_per_s']!s:>10}{r['trajectories']:>8}{r['seconds']:>8}{r['mean_reward']:>8}"
        )


if __name__ == "__main__":
    main()
