"""Prometheus scrapes what runs: a real Prometheus (Debian's package, unpacked by
scripts/setup-infra-tools.sh) with the shipped ``infra/prometheus.yml``, and a real ``rlstream run``
of the next-digit job with a metrics port base. Every target the launcher announced through file
discovery must be up, and every query of the shipped Grafana dashboard must return data."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import rlstream_cmd
from tests.helpers import free_port_block

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "infra/grafana/dashboards/rlstream.json"
BIN = Path(os.environ.get("RLSTREAM_CACHE", Path.home() / ".cache/rlstream")) / "bin"


def prometheus_binary() -> str | None:
    local = BIN / "prometheus"
    return str(local) if local.is_file() else shutil.which("prometheus")


def api(base_url: str, path: str, **params) -> dict:
    url = f"{base_url}{path}?{urllib.parse.urlencode(params)}" if params else f"{base_url}{path}"
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


@pytest.mark.skipif(prometheus_binary() is None, reason="no prometheus binary: run scripts/setup-infra-tools.sh")
def test_every_shipped_target_is_up_and_every_dashboard_query_has_data(cli_env, tmp_path):
    # The shipped config, unchanged, beside a runs/ dir: its file_sd path is relative to the file.
    (tmp_path / "infra").mkdir()
    config = tmp_path / "infra/prometheus.yml"
    shutil.copy(REPO / "infra/prometheus.yml", config)
    runs = tmp_path / "runs"
    env = {**cli_env, "RLSTREAM_RUN_DIR": str(runs)}
    prom_port, metrics_base = free_port_block(1), free_port_block(31)
    prom = subprocess.Popen(
        [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=open(tmp_path / "prometheus.log", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    name = f"prom-{os.getpid()}-{time.monotonic_ns() % 10**6}"  # its own groups on a shared broker
    # More steps than the test lasts: the test stops the job (400 steps took only ~55 s once reward
    # batches closed when idle, about as long as the panels take to fill). SIGTERM, not SIGINT:
    # the CLI turns both into the same clean stop, but a shell starts background jobs with SIGINT
    # ignored, and an ignored SIGINT stays ignored in the job.
    job = subprocess.Popen(
        [*rlstream_cmd(), "run", str(REPO / "examples/next-digit.toml"), "--steps", "100000", "--no-live",
         "--set", f"job.name={json.dumps(name)}", "--set", f"job.metrics_port_base={metrics_base}"],
        env=env, stdout=open(tmp_path / "job.out", "w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{prom_port}"
    try:
        sd_file = runs / "prometheus" / f"{name}.json"
        deadline = time.monotonic() + 600
        targets: list = []
        missing: list = [q for q in dashboard_queries()]
        while time.monotonic() < deadline:
            assert job.poll() is None, "the job ended early:\n" + (tmp_path / "job.out").read_text()[-3000:]
            assert prom.poll() is None, "prometheus died:\n" + (tmp_path / "prometheus.log").read_text()[-3000:]
            announced = (
                {t for g in json.loads(sd_file.read_text()) for t in g["targets"]} if sd_file.is_file() else set()
            )
            try:
                targets = api(url, "/api/v1/targets")["activeTargets"]
                missing = [(t, q) for t, q in missing if not api(url, "/api/v1/query", query=q)["result"]]
            except OSError:  # prometheus still starting
                time.sleep(1)
                continue
            up = {t["labels"]["instance"] for t in targets if t["health"] == "up"}
            if announced and announced <= up and not missing:
                break
            time.sleep(2)
        status = {t["labels"]["instance"]: (t["health"], t.get("lastError")) for t in targets}
        assert announced and announced <= {i for i, (h, _) in status.items() if h == "up"}, (announced, status)
        # one target per port-carrying role: 2 rollout, 2 reward, 1 trainer (next-digit.toml)
        assert len(announced) == 5, announced
        assert {t["labels"].get("process") for t in targets} >= {"rollout-0", "reward-1", "trainer"}
        assert not missing, f"dashboard panels without data: {missing}"
        # the version panel's series: workers holding weights only; a reward worker has no version
        # (it used to be exported as -1 and plotted as such)
        versions = api(url, "/api/v1/query", query="rlstream_policy_version")["result"]
        assert {v["metric"]["role"] for v in versions} == {"trainer", "rollout"}, versions
        assert all(float(v["value"][1]) >= 0 for v in versions), versions
    finally:
        for proc in (job, prom):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        job.wait(180)
        prom.wait(60)
    assert not sd_file.exists(), "the launcher leaves its discovery file behind"
