"""The driver behind ``rlstream bench``: one run directory per invocation, a broker (the configured
one or a local broker started for the run), each requested benchmark in turn, then
``summary.json`` and, with ``--docs``, the generated tables of docs/results/performance.md.

Benchmarks are modules with ``run(ctx) -> result`` and ``table(result) -> markdown``; results
carry the paths of their PNG plots. They print figures and assert nothing. A module with
``NEEDS_KAFKA = False`` (the ceiling model) gets no broker when it runs alone; one with a
``preflight()`` (trl, peer: TRL installed?) has it called before anything starts.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from contextlib import nullcontext
from pathlib import Path

from rlstream.dev.bench.harness import BenchContext, broker, img_dir_of, machine, py_spy, update_docs, write_json

BENCHMARKS = {
    "async": "rlstream.dev.bench.async_sync",
    "agentic": "rlstream.dev.bench.agentic",
    "transport": "rlstream.dev.bench.transport",
    "weights": "rlstream.dev.bench.weights",
    "scaling": "rlstream.dev.bench.scaling",
    "ceiling": "rlstream.dev.bench.ceiling",
    "learn": "rlstream.dev.bench.learn",
    "barrier": "rlstream.dev.bench.barrier",
    "trl": "rlstream.dev.bench.trl_peer",
    "peer": "rlstream.dev.bench.peer",
    "trace": "rlstream.dev.bench.step_trace",
    "staleness": "rlstream.dev.bench.staleness",
}
LONG = {"learn", "barrier", "trl", "peer", "trace", "staleness"}
"""Not part of ``bench all``: an hour or more per run at the full size, an optional extra (TRL for
``trl`` and ``peer``), or a diagnosis (``trace``: where a k = 0 step goes): run them by name."""
ALL = [n for n in BENCHMARKS if n not in LONG]
TITLES = {
    "async": "async vs sync",
    "agentic": "agentic: environment-level async vs turn-sync",
    "transport": "transport overhead",
    "weights": "weight-notice latency",
    "scaling": "scale on one broker",
    "ceiling": "scheduling ceiling (event model)",
    "learn": "staleness against quality (real model)",
    "barrier": "over-provisioned groups against the default rule (real model)",
    "trl": "TRL's GRPOTrainer side by side (real model)",
    "peer": "TRL's GRPOTrainer against rlstream k = 0, 1, 2 (next-digit)",
    "trace": "where a k = 0 step goes (next-digit)",
    "staleness": "learning under staleness, in samples, over seeds (tiny model)",
}


def run(
    names: list[str],
    cfg,
    config_path: Path | None = None,
    sets: list[str] | None = None,
    size: str = "full",
    out: Path | None = None,
    docs: Path | None = None,
    bootstrap: str | None = None,
    profile: bool = False,
    engines: list[str] | None = None,
    say=print,
    extra: dict | None = None,
) -> dict:
    """Run the named benchmarks; returns the summary (``results`` by name, ``run_dir``). ``cfg`` is
    the user's resolved config (run_dir, Kafka); ``config_path``/``sets`` are layered under each
    benchmark's own settings."""
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.WARNING))  # the roles' logs go to files
    run_id = time.strftime("%Y%m%d-%H%M%S")
    out = Path(out or Path(cfg.run_dir) / f"bench-{run_id}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"run_dir": str(out), "size": size, "machine": machine(), "results": {}}
    t0 = time.monotonic()
    if profile and py_spy() is None:
        say("[bench] --profile: py-spy not found (pip install py-spy); the benchmarks run without profiles")
    for n in names:  # a missing optional extra fails here, before a broker starts
        getattr(importlib.import_module(BENCHMARKS[n]), "preflight", lambda: None)()
    needs_kafka = any(getattr(importlib.import_module(BENCHMARKS[n]), "NEEDS_KAFKA", True) for n in names)
    kafka = broker(bootstrap or cfg.kafka.bootstrap_servers, say) if needs_kafka else nullcontext((None, None))
    with kafka as (bs, broker_pid):
        ctx = BenchContext(
            out, bs, config_path, list(sets or []), size, run_id, say, profile, dict(extra or {}), broker_pid
        )
        for name in names:
            mod = importlib.import_module(BENCHMARKS[name])
            say(f"[bench] {name}: starting ({size})")
            t = time.monotonic()
            load = round(os.getloadavg()[0], 2)
            result = mod.run(ctx, engines) if name == "async" else mod.run(ctx)
            result["loadavg_at_start"] = load
            result["seconds"] = round(time.monotonic() - t, 1)
            summary["results"][name] = result
            write_json(out / "summary.json", summary)
            say(f"\n## {TITLES[name]} ({result['seconds']} s)\n\n{mod.table(result)}\n")
    summary["total_seconds"] = round(time.monotonic() - t0, 1)
    summary["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(out / "summary.json", summary)
    if docs:
        cmd = f"rlstream bench {'all' if names == ALL else ' '.join(names)} --size {size}"
        cmd += " --profile" if profile else ""
        cmd += f" --budget-s {extra['budget_s']:g}" if extra and extra.get("budget_s") else ""
        cmd += f" --seeds {','.join(map(str, extra['seeds']))}" if extra and extra.get("seeds") else ""
        cmd += f" --ks {','.join(map(str, extra['ks']))}" if extra and extra.get("ks") else ""
        cmd += f" --rules '{','.join(extra['rules'])}'" if extra and extra.get("rules") else ""
        cmd += f" --against {Path(extra['against']).name}" if extra and extra.get("against") else ""
        for name, result in summary["results"].items():
            mod = importlib.import_module(BENCHMARKS[name])
            imgs = [Path(p) for p in result.get("plots", [])]
            rel = os.path.relpath(img_dir_of(Path(docs)) / "bench", Path(docs).parent)
            links = "\n".join(f"![{p.stem}]({rel}/{p.name})" for p in imgs)
            m = summary["machine"]
            cpu = f"{m['cpus']} CPUs ({m.get('cpu_model') or 'model unknown'}; {' '.join(m.get('cpu_flags') or []) or 'no AVX'})"
            meta = (
                f"_Generated by `{cmd}` on {m['time']} (git {m['git']}, {cpu}, 1-minute load average "
                f"{result['loadavg_at_start']} when this benchmark started); {result['seconds']} s._"
            )
            update_docs(docs, name, f"{meta}\n\n{mod.table(result)}\n\n{links}", imgs)
        say(f"[bench] updated {docs}")
    say(f"[bench] done in {summary['total_seconds']} s; results in {out}")
    return summary
