"""Benchmark 3, part 3: weight sync at model scale, without Kafka in the timed path.

Synthetic bf16 state dicts with Llama shapes (``full``: ~1 GB, hidden 2048 x 8 layers, and ~4 GB,
hidden 4096 x 9 layers, vocab 32000; ``tiny``: ~10 MB) are written by the trainer's writer
(``pipeline.checkpoint.write_weights``, sharded at ``trainer.shard_bytes``, shards in parallel,
index last). Then the notice (the WeightUpdate record) goes to 1 or 2 rollout workers, which are
separate **processes** (as rollout workers are: no shared GIL, no shared buffers), each holding an
engine-like destination (a dict of tensors of the model's shapes). Each worker does what the hf
engine does with a full update: ``prepare`` = ``iter_weights`` (index verified, shards read and
sha256-verified in parallel threads, each staged as soon as it is verified), then ``load`` = the
swap of the staged tensors into the destination (``load_state_dict(assign=True)`` in the engine):
that swap is the generation pause. Separately, once every worker has loaded, worker 0 measures
the pause of an engine that must copy in place (vLLM, CUDA graphs): copying the verified tensors
into preallocated, resident tensors.

Reported per case: the trainer's write time and GB/s, notice -> every worker loaded (the
``effective GB/s`` is the state dict's bytes over that time), per worker fetch + verify time and
when its first shard was ready (the streaming), the swap and copy pauses, and the sha256 rate of
one core measured at the time (every byte is hashed once per worker: with W workers on C cores
verification alone bounds the effective rate to C x rate / W). ``cold`` rows drop the files from
the page cache first (fsync, then ``posix_fadvise(DONTNEED)``), so the shards come from the disk.
A LoRA-sized adapter (r = 8 on q/v of 32 layers of hidden 4096, bf16, ~17 MB) goes through
``write_adapter`` / ``read_adapter``, its pause a copy into resident adapter tensors.

The notice itself travels over a pipe here; its Kafka latency is part 1 of this benchmark. Cases
that would not fit in the free memory or disk are skipped, saying so. It prints figures; it
asserts nothing. Files are deleted afterwards.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import statistics
import time
from pathlib import Path

from pipeline.checkpoint import (
    io_threads,
    iter_weights,
    read_adapter,
    version_dir,
    write_adapter,
    write_weights,
)
from rlstream.dev.bench.harness import BenchContext, log_line, md_table, rnd

GB = 1e9
SCALE = {
    "tiny": {
        "models": [("10MB", 256, 688, 4, 4096)],
        "shard_bytes": 2 << 20,
        "workers": [2],
        "cold": False,
        "reps": 2,
        "adapter": (256, 4),
        "adapter_reps": 3,
    },
    "full": {
        "models": [("1GB", 2048, 5504, 8, 32000), ("4GB", 4096, 11008, 9, 32000)],
        "shard_bytes": None,  # trainer.shard_bytes' default
        "workers": [1, 2],
        "cold": True,
        "reps": 2,
        "adapter": (4096, 32),
        "adapter_reps": 5,
    },
}


def llama_spec(hidden: int, inter: int, layers: int, vocab: int) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of a Llama checkpoint in HF names (bf16, no GQA, untied head)."""
    spec = [("model.embed_tokens.weight", (vocab, hidden), "bfloat16")]
    for i in range(layers):
        p = f"model.layers.{i}"
        spec += [(f"{p}.self_attn.{m}_proj.weight", (hidden, hidden), "bfloat16") for m in "qkvo"]
        spec += [(f"{p}.mlp.{m}_proj.weight", (inter, hidden), "bfloat16") for m in ("gate", "up")]
        spec += [(f"{p}.mlp.down_proj.weight", (hidden, inter), "bfloat16")]
        spec += [(f"{p}.{n}.weight", (hidden,), "bfloat16") for n in ("input_layernorm", "post_attention_layernorm")]
    spec += [("model.norm.weight", (hidden,), "bfloat16"), ("lm_head.weight", (vocab, hidden), "bfloat16")]
    return spec


def adapter_spec(hidden: int, layers: int, r: int = 8) -> list[tuple[str, tuple, str]]:
    """PEFT names of a LoRA adapter of rank ``r`` on q_proj and v_proj."""
    spec = []
    for i in range(layers):
        for m in ("q_proj", "v_proj"):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}"
            spec += [(f"{p}.lora_A.weight", (r, hidden), "bfloat16"), (f"{p}.lora_B.weight", (hidden, r), "bfloat16")]
    return spec


def spec_bytes(spec) -> int:
    import torch

    return sum(int(torch.Size(s).numel()) * getattr(torch, d).itemsize for _, s, d in spec)


def materialize(spec, seed: int = 0) -> dict:
    import torch

    sd = {}
    for i, (name, shape, dtype) in enumerate(spec):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        t.fill_(((seed * 131 + i) % 97) / 97.0)  # cheap; the content does not matter to sha256 or the disk
        sd[name] = t
    return sd


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def sha256_rate(mb: int = 256) -> float:
    """GB/s of sha256 on one core right now (the machine may be busy)."""
    buf = bytearray(os.urandom(1 << 20)) * mb
    t0 = time.perf_counter()
    hashlib.sha256(buf).hexdigest()
    return len(buf) / (time.perf_counter() - t0) / GB


def drop_cache(directory: Path) -> None:
    """fsync every file of ``directory``, then ask the kernel to drop its pages (no root needed)."""
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ---- the rollout-worker process ----------------------------------------------------------------------
def _worker(conn, spec, adapter, threads: int) -> None:
    import torch

    torch.set_num_threads(1)

    def fresh() -> dict:  # the engine's weights; a swap never reads them, so they need not be resident
        return {n: torch.empty(s, dtype=getattr(torch, d)) for n, s, d in spec}

    dest = fresh()
    adest = {n: torch.zeros(s, dtype=getattr(torch, d)) for n, s, d in adapter}  # resident LoRA layers
    staged: dict = {}
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        kind, update = msg
        t0, c0 = time.monotonic(), time.process_time()
        if kind == "full":
            staged, first, shards = {}, None, 0
            for _, tensors in iter_weights(update["uri"], update["sha256"], threads=threads):
                first = first or time.monotonic()
                shards += 1
                staged.update(tensors)  # hf engine: converted to the engine's dtype/device here (a no-op)
            t1 = time.monotonic()
            bad = [k for k in dest if k not in staged or staged[k].shape != dest[k].shape]
            if bad:
                raise ValueError(f"checkpoint does not fit: {bad[:3]}")
            dest = dict(staged)  # the pause: a swap (assign=True), old weights released
            t2 = time.monotonic()
            conn.send({"t_loaded": t2, "first_shard_s": first - t0, "fetch_s": t1 - t0, "pause_ms": (t2 - t1) * 1e3,
                       "shards": shards, "cpu_s": time.process_time() - c0})  # fmt: skip
        elif kind == "reset":  # release the last version (keeps the benchmark within memory)
            staged, dest = {}, fresh()
            conn.send({})
        elif kind == "copy":  # an in-place engine: copy the verified tensors into resident ones
            resident = {k: torch.zeros_like(v) for k, v in staged.items()}
            t1 = time.monotonic()
            for k, v in staged.items():
                resident[k].copy_(v)
            conn.send({"copy_pause_ms": (time.monotonic() - t1) * 1e3})
            del resident
        elif kind == "adapter":
            state, _ = read_adapter(update["uri"], update["sha256"])
            t1 = time.monotonic()
            for k, v in state.items():
                adest[k].copy_(v)  # PeftApplier copies into the injected LoRA layers
            t2 = time.monotonic()
            conn.send({"t_loaded": t2, "fetch_s": t1 - t0, "pause_ms": (t2 - t1) * 1e3})
    conn.close()


class Workers:
    """``n`` rollout-worker processes, each with a destination of ``spec``'s shapes."""

    def __init__(self, n: int, spec, adapter, threads: int):
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, spec, adapter, threads), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(300) or c.recv() != "ready":
                raise RuntimeError("a benchmark worker did not start")

    def publish(self, kind: str, update: dict) -> tuple[float, list[dict]]:
        t_pub = time.monotonic()
        for c in self.conns:
            c.send((kind, update))
        return t_pub, [self._recv(c) for c in self.conns]

    def ask(self, i: int, kind: str) -> dict:
        self.conns[i].send((kind, None))
        return self._recv(self.conns[i])

    def reset(self) -> None:
        for i in range(len(self.conns)):
            self.ask(i, "reset")

    def _recv(self, c) -> dict:
        if not c.poll(1800):
            raise TimeoutError("a benchmark worker did not answer in 30 min")
        return c.recv()

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs, strict=True):
            try:
                c.send(None)
            except OSError:
                pass
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()


# ---- cases ---------------------------------------------------------------------------------------------
def full_case(ctx: BenchContext, store: Path, model: tuple, sz: dict, v: int) -> list[dict]:
    label, hidden, inter, layers, vocab = model
    spec = llama_spec(hidden, inter, layers, vocab)
    nbytes = spec_bytes(spec)
    shard = sz["shard_bytes"] or _default_shard_bytes()
    workers = sz["workers"]
    need_mem, free_mem = int(nbytes * 2.3), mem_available()  # the trainer's copy, then page cache + a resident copy
    need_disk, free_disk = int(nbytes * 1.2), shutil.disk_usage(store).free
    if free_mem < need_mem or free_disk < need_disk:
        why = f"needs {need_mem / GB:.1f} GB memory and {need_disk / GB:.1f} GB disk; {free_mem / GB:.1f} and {free_disk / GB:.1f} free"
        ctx.say(f"[bench] weights-scale {label}: skipped ({why})")
        return [{"model": label, "skipped": why}]
    sd = materialize(spec, v)
    t0, c0 = time.monotonic(), time.process_time()
    uri, sha, written = write_weights(str(store), v, sd, shard_bytes=shard)
    write_s, write_cpu = time.monotonic() - t0, time.process_time() - c0
    del sd
    update = {"version": v, "uri": uri, "sha256": sha, "bytes": written}
    rows = []
    variants = [(w, False) for w in workers] + ([(max(workers), True)] if sz["cold"] else [])
    for n, cold in variants:
        pool = Workers(n, spec, [], io_threads())
        try:
            reps = []
            for _ in range(1 if cold else sz["reps"]):
                pool.reset()
                if cold:
                    drop_cache(Path(version_dir(str(store), v)))
                rate = sha256_rate(64)
                t_pub, res = pool.publish("full", update)
                reps.append((max(r["t_loaded"] for r in res) - t_pub, res, rate))
            copy_ms = pool.ask(0, "copy")["copy_pause_ms"] if mem_available() > nbytes * 1.2 else None
        finally:
            pool.close()
        all_s = statistics.median(r[0] for r in reps)
        cpus = os.cpu_count() or 1
        worker_cpu = statistics.median(x["cpu_s"] for _, res, _ in reps for x in res)
        each = [x for _, res, _ in reps for x in res]
        rate = statistics.median(r[2] for r in reps)
        row = {
            "model": label,
            "state_dict_GB": rnd(nbytes / GB, 3),
            "shards": each[0]["shards"],
            "workers": n,
            "cache": "cold" if cold else "hot",
            "reps": len(reps),
            "write_s": rnd(write_s, 2),
            "write_GBps": rnd(nbytes / write_s / GB, 2),
            "all_loaded_s": rnd(all_s, 2),
            "effective_GBps": rnd(nbytes / all_s / GB, 2),
            "write_to_all_loaded_GBps": rnd(nbytes / (write_s + all_s) / GB, 2),
            "fetch_verify_s_p50": rnd(statistics.median(x["fetch_s"] for x in each), 2),
            "first_shard_s_p50": rnd(statistics.median(x["first_shard_s"] for x in each), 3),
            "pause_swap_ms_max": rnd(max(x["pause_ms"] for x in each), 2),
            "pause_copy_ms": rnd(copy_ms, 1),
            "sha256_GBps_1core": rnd(rate, 2),
            "hash_bound_GBps": rnd(min(n * io_threads(), cpus) * rate / n, 2),
            "worker_cpu_s_per_GB": rnd(statistics.median(x["cpu_s"] for x in each) / (nbytes / GB), 2),
            "uncontended_GBps": rnd(nbytes / GB / max(worker_cpu * n / cpus, worker_cpu / io_threads()), 2),
            "write_cpu_s_per_GB": rnd(write_cpu / (nbytes / GB), 2),
            "loadavg": round(os.getloadavg()[0], 2),
        }
        rows.append(row)
        log_line(ctx, f"weights-scale {label}", workers=n, cache=row["cache"], all_loaded_s=row["all_loaded_s"],
                 GBps=row["effective_GBps"], pause_ms=row["pause_swap_ms_max"], copy_ms=row["pause_copy_ms"])  # fmt: skip
    return rows


def adapter_case(ctx: BenchContext, store: Path, sz: dict, v: int) -> dict:
    hidden, layers = sz["adapter"]
    spec = adapter_spec(hidden, layers)
    conf = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    n = max(sz["workers"])
    pool = Workers(n, [], spec, io_threads())
    times, writes, each = [], [], []
    try:
        for i in range(sz["adapter_reps"]):
            sd = materialize(spec, v + i)
            t0 = time.monotonic()
            uri, sha, nbytes = write_adapter(str(store), v + i, sd, conf)
            writes.append(time.monotonic() - t0)
            t_pub, res = pool.publish("adapter", {"uri": uri, "sha256": sha})
            times.append(max(r["t_loaded"] for r in res) - t_pub)
            each += res
    finally:
        pool.close()
    row = {
        "adapter_MB": rnd(nbytes / 1e6, 2),
        "workers": n,
        "reps": len(times),
        "write_ms_p50": rnd(statistics.median(writes) * 1e3, 1),
        "all_loaded_ms_p50": rnd(statistics.median(times) * 1e3, 1),
        "all_loaded_ms_max": rnd(max(times) * 1e3, 1),
        "fetch_verify_ms_p50": rnd(statistics.median(x["fetch_s"] for x in each) * 1e3, 1),
        "pause_ms_max": rnd(max(x["pause_ms"] for x in each), 2),
    }
    log_line(ctx, "weights-scale adapter", MB=row["adapter_MB"], all_loaded_ms=row["all_loaded_ms_p50"],
             pause_ms=row["pause_ms_max"])  # fmt: skip
    return row


def _default_shard_bytes() -> int:
    from consumers.trainer.config import TrainerConfig

    return TrainerConfig().shard_bytes


def run(ctx: BenchContext) -> dict:
    sz = SCALE[ctx.size]
    store = ctx.out / "weights-scale" / "store"
    store.mkdir(parents=True, exist_ok=True)
    out: dict = {"shard_bytes": sz["shard_bytes"] or _default_shard_bytes(), "io_threads": io_threads()}
    try:
        rows = []
        for i, model in enumerate(sz["models"]):
            rows += full_case(ctx, store, model, sz, i + 1)
            shutil.rmtree(version_dir(str(store), i + 1), ignore_errors=True)
        out["full"] = rows
        out["adapter"] = adapter_case(ctx, store, sz, 100)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    return out


def table(result: dict) -> str:
    rows = [r for r in result.get("full", []) if "skipped" not in r]
    a = md_table(
        ["state dict", "shards", "workers", "page cache", "trainer write s (GB/s)", "notice → all loaded s",
         "effective GB/s", "fetch+verify s p50", "first shard s", "pause: swap ms", "pause: in-place copy ms",
         "sha256 GB/s/core", "hash bound GB/s"],
        [[f"{r['model']} ({r['state_dict_GB']} GB)", r["shards"], r["workers"], r["cache"],
          f"{r['write_s']} ({r['write_GBps']})", r["all_loaded_s"], r["effective_GBps"], r["fetch_verify_s_p50"],
          r["first_shard_s_p50"], r["pause_swap_ms_max"], r["pause_copy_ms"], r["sha256_GBps_1core"],
          r["hash_bound_GBps"]] for r in rows],
    )  # fmt: skip
    skipped = [f"{r['model']}: skipped ({r['skipped']})" for r in result.get("full", []) if "skipped" in r]
    ad = result.get("adapter") or {}
    b = md_table(
        ["adapter MB", "workers", "versions", "write ms p50", "notice → all loaded ms p50", "max",
         "fetch+verify ms p50", "pause ms max"],
        [[ad.get("adapter_MB"), ad.get("workers"), ad.get("reps"), ad.get("write_ms_p50"), ad.get("all_loaded_ms_p50"),
          ad.get("all_loaded_ms_max"), ad.get("fetch_verify_ms_p50"), ad.get("pause_ms_max")]],
    )  # fmt: skip
    return "\n\n".join([a, *skipped, f"LoRA adapter (r = 8 on q/v, bf16):\n\n{b}"])
