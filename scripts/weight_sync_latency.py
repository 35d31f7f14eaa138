"""Weight sync latency, full weights vs LoRA adapter: publish -> loaded on a rollout engine.

For each model (the default tiny model, and a larger random-init Llama built in code) and each
kind (full fine-tuning, LoRA), a real ``TorchEngine`` produces the weights to publish and the
trainer's own code path writes them (``consumers.trainer.publish.write_version``: safetensors, or
the adapter in PEFT layout) and announces them on rl.control (``publish_weight_update``, waiting
for the broker's ack). A rollout side in the same process -- ``producers.weights.WeightSync`` (it
follows rl.control, fetches and verifies the sha256 on its background thread) and the real ``hf``
engine -- loads each version as soon as it is loadable (in place for full weights, into the PEFT
layers for an adapter). Measured per version (time.monotonic, one process, so one clock):

* ``write``: engine.state_dict() + write + publish until acked (the trainer's share);
* ``notice->loaded``: from the acked notice to the engine holding the version (follow, fetch,
  verify, swap);
* ``publish->loaded``: the sum: from the end of the optimizer step to weights in the engine.

Prints a Markdown table (median over versions 2..N; version 1 also pays one-off costs such as
PEFT's layer injection and hashing the base for its fingerprint). Needs a broker:
``KAFKA_BOOTSTRAP`` or a local one started here (``rlstream broker``). Run:

    python scripts/weight_sync_latency.py [--versions 6] [--large-hidden 1024 --large-layers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path


def build_large(root: Path, hidden: int, layers: int, vocab: int) -> Path:
    """A random-init Llama (float32 safetensors) with the tiny model's character tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.models import build_char_tokenizer

    d = root / f"llama-h{hidden}-l{layers}-v{vocab}"
    if (d / "config.json").is_file():
        return d
    tok = build_char_tokenizer()
    lc = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(lc).save_pretrained(d, safe_serialization=True)
    tok.save_pretrained(d)
    return d


def measure(cfg, model_dir: Path, lora: bool, versions: int) -> dict:
    from consumers.trainer.config import LoraConfig
    from consumers.trainer.engines import TrainContext, build_engine
    from consumers.trainer.publish import write_version
    from libs.engines import EngineContext
    from libs.engines.hf import HFEngine
    from pipeline.checkpoint import model_fingerprint
    from pipeline.control import publish_weight_update
    from pipeline.kafka import Producer, client_conf
    from pipeline.models import load_tokenizer
    from producers.config import HFEngineConfig
    from producers.weights import WeightSync

    tc = cfg.trainer
    if lora:
        tc = tc.model_copy(update={"lora": LoraConfig()})
    eng = build_engine(tc.engine, TrainContext(model_dir, tc))
    base_sha = model_fingerprint(model_dir) if lora else ""
    tok = load_tokenizer(model_dir)
    hf = HFEngine(HFEngineConfig(), EngineContext(model_dir, tok, "bench"))
    sync = WeightSync(cfg, "bench", hf)
    sync.catch_up(30)
    loaded: dict[int, float] = {}
    stop = threading.Event()

    def follow():
        while not stop.is_set():
            sync.poll()
            if sync.loadable is not None:
                upd, _, _ = sync.load()
                loaded[int(upd["version"])] = time.monotonic()
            else:
                time.sleep(0.001)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    producer = Producer(client_conf(cfg, "bench", kind="producer"))
    rows = []
    store = tempfile.mkdtemp(prefix="wsync-")
    try:
        for v in range(1, versions + 1):
            for p in eng.params:  # a different version each time (the values do not matter)
                p.data.add_(1e-3)
            t0 = time.monotonic()
            update = write_version(eng, eng.state_dict(), store, v, v, tc, v * 8, base_sha)
            publish_weight_update(producer, cfg.topics.name("control"), update)
            t1 = time.monotonic()
            deadline = t1 + 300
            while v not in loaded and time.monotonic() < deadline:
                time.sleep(0.0005)
            if v not in loaded:
                raise TimeoutError(f"version {v} never loaded")
            rows.append({"bytes": update["bytes"], "write": t1 - t0, "notice": loaded[v] - t1, "total": loaded[v] - t0})
    finally:
        stop.set()
        t.join(10)
        producer.close()
        sync.close()
    steady = rows[1:] or rows
    med = {k: statistics.median(r[k] for r in steady) for k in ("write", "notice", "total")}
    return {"bytes": rows[-1]["bytes"], **med, "first_total": rows[0]["total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--large-hidden", type=int, default=1024)
    ap.add_argument("--large-layers", type=int, default=8)
    ap.add_argument("--large-vocab", type=int, default=32000)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("RLSTREAM_QUIET", "1")
    from pipeline.admin import ensure_topics
    from pipeline.models import materialize
    from rlstream.config import load_config

    with contextlib.ExitStack() as stack:
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP")
        if not bootstrap:
            from rlstream.broker import LocalBroker
            from rlstream.config import BrokerConfig

            data = stack.enter_context(tempfile.TemporaryDirectory(prefix="wsync-broker-"))
            broker = LocalBroker(BrokerConfig(port=0, data_dir=data, heap_mb=512))
            bootstrap = broker.start(progress=print, owned=True)["bootstrap"]
            stack.callback(broker.stop)
        cache = Path(tempfile.gettempdir()) / "rlstream-wsync-models"
        cache.mkdir(exist_ok=True)
        results = []
        tiny_cfg = load_config(None, ["model.type=tiny"], environ={})
        models = {
            "tiny (hidden 128, 2 layers)": materialize(tiny_cfg.model),
            f"Llama hidden {args.large_hidden}, {args.large_layers} layers, vocab {args.large_vocab}": build_large(
                cache, args.large_hidden, args.large_layers, args.large_vocab
            ),
        }
        for label, d in models.items():
            for lora in (False, True):
                prefix = f"wsync-{uuid.uuid4().hex[:8]}."
                cfg = load_config(
                    None,
                    [f"kafka.bootstrap_servers={bootstrap}", f"topics.prefix={prefix}",
                     f'model={{type = "pretrained", path = {json.dumps(str(d))}}}'],
                    environ={},
                )  # fmt: skip
                ensure_topics(cfg, ["control"])
                r = measure(cfg, d, lora, args.versions)
                r.update(model=label, kind="adapter (LoRA r=8, all linear)" if lora else "full")
                print(json.dumps(r), flush=True)
                results.append(r)
    print()
    print(
        "| model | kind | bytes | write + publish (ms) | notice -> loaded (ms) | publish -> loaded (ms) | first version (ms) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['model']} | {r['kind']} | {r['bytes']:,} | {r['write'] * 1e3:.1f} | {r['notice'] * 1e3:.1f} | "
            f"{r['total'] * 1e3:.1f} | {r['first_total'] * 1e3:.0f} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
