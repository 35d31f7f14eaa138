"""infra/docker-compose.yml and the Dockerfile, checked without a Docker engine.

The compose file is loaded the way `docker compose config` loads it: by that command when the
Compose CLI plugin is installed, else by compose-config (compose-spec's own loader, built by
scripts/setup-infra-tools.sh), which validates it against the Compose schema. The Dockerfile cannot
be built here; it is parsed and its parts are checked against the repository."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache

import pytest
import yaml

from tests.infra_tools import REPO, SETUP, rlstream, tool

COMPOSE = REPO / "infra/docker-compose.yml"
ROLE_SERVICES = ("topics", "feed", "rollout", "reward", "trainer")


@cache
def compose_loader() -> list[str] | None:
    docker = tool("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose", "--profile", "monitoring", "-f", str(COMPOSE), "config", "--format", "json"]
    if cc := tool("compose-config"):
        return [cc, "-profile", "monitoring", str(COMPOSE)]
    return None


@cache
def project() -> dict:
    cmd = compose_loader()
    if cmd is None:
        pytest.skip(f"no compose loader: neither `docker compose` nor compose-config (run {SETUP})")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return json.loads(proc.stdout)


def test_compose_file_validates_and_pins_every_image():
    services = project()["services"]
    assert set(services) == {*ROLE_SERVICES, "kafka", "kafbat-ui", "prometheus", "grafana"}
    for name, svc in services.items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and "/" not in tag and tag and tag != "latest", f"{name}: image {image!r} is not pinned"
    assert services["kafka"]["image"].startswith("apache/kafka:4.")
    for name in ROLE_SERVICES:  # built from the repo's Dockerfile, configured by environment and job.toml
        svc = services[name]
        assert svc["build"]["dockerfile"] == "Dockerfile" and os.path.samefile(svc["build"]["context"], REPO)
        assert svc["environment"]["RLSTREAM_KAFKA__BOOTSTRAP_SERVERS"] == "kafka:29092"
        assert svc["init"] is True


def test_every_role_command_is_a_real_rlstream_command():
    services = project()["services"]
    job = REPO / "infra/compose/job.toml"
    for name in ROLE_SERVICES:
        svc = services[name]
        cmd = svc["command"]
        words = list(cmd[: 2 if cmd[0] == "topics" else 1])
        helped = rlstream(*words, "--help")
        assert helped.returncode == 0, f"{name}: `rlstream {' '.join(words)}` is not a command\n{helped.stderr}"
        env = {k: v for k, v in svc["environment"].items() if k != "RLSTREAM_CONFIG"}
        shown = rlstream("config", "show", "--json", "--config", str(job), *cmd[len(words) :], env=env)
        assert shown.returncode == 0, f"{name}: {shown.stdout}{shown.stderr}"  # every --set key exists and is valid
        mount = next(v for v in svc["volumes"] if v["target"] == "/etc/rlstream")
        assert os.path.samefile(mount["source"], job.parent)
    cfg = json.loads(rlstream("config", "show", "--json", "--config", str(job)).stdout)
    assert (job.parent / os.path.basename(cfg["feed"]["source"])).is_file()


def test_roles_restart_on_failure_and_stay_stopped_when_done():
    """docs/how-to/multi-machine.md: a role that exits non-zero is restarted; one that finished (exit 0: the
    feed at its limit, the trainer at max_steps) stays stopped. The one-shot topic creation is
    waited for by `up` (service_completed_successfully), so it is not restarted."""
    services = project()["services"]
    assert services["topics"]["restart"] == "no"
    for name in set(ROLE_SERVICES) - {"topics"}:
        assert services[name]["restart"] == "on-failure", f"{name}: restart {services[name].get('restart')!r}"
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_prometheus_scrapes_the_compose_roles():
    services = project()["services"]
    mount = next(v for v in services["prometheus"]["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml")
    assert os.path.basename(mount["source"]) == "prometheus-compose.yml"
    scrape = yaml.safe_load(open(mount["source"]))
    targets = {(d["names"][0], d["port"]) for job in scrape["scrape_configs"] for d in job["dns_sd_configs"]}
    expected = set()
    for role in ("rollout", "reward", "trainer"):
        svc = services[role]
        (setting,) = [a for a in svc["command"] if ".prometheus_port=" in a]
        port = int(setting.rpartition("=")[2])
        assert setting.startswith(f"{role}.") and str(port) in svc["expose"]
        expected.add((role, port))
    assert targets == expected
    grafana = services["grafana"]
    assert {v["target"] for v in grafana["volumes"]} == {"/etc/grafana/provisioning", "/var/lib/grafana/dashboards"}
    assert all(os.path.isdir(v["source"]) for v in grafana["volumes"])
    assert "monitoring" in services["prometheus"]["profiles"] and "monitoring" in grafana["profiles"]


def test_kafbat_ui_loads_the_rlstream_serde():
    ui = project()["services"]["kafbat-ui"]
    env, mounts = ui["environment"], {v["target"]: v["source"] for v in ui["volumes"]}
    cls = env["KAFKA_CLUSTERS_0_SERDE_0_CLASSNAME"]
    assert (REPO / "infra/kafbat-serde/src/main/java" / (cls.replace(".", "/") + ".java")).is_file()
    assert os.path.realpath(mounts[env["KAFKA_CLUSTERS_0_SERDE_0_FILEPATH"]]) == str(
        REPO / "infra/kafbat-serde/target/plugin"
    )
    assert os.path.samefile(mounts[env["KAFKA_CLUSTERS_0_SERDE_0_PROPERTIES_SCHEMASDIR"]], REPO / "schemas")


def test_kafbat_serde_is_the_default_for_every_rlstream_topic_of_any_job():
    """The shipped compose file's topic pattern (read as YAML, no loader needed), used the way Kafbat
    uses it (``Pattern.matcher(topic).matches()``: a full match), and the same pattern in the docs."""
    from pipeline.config import TopicsConfig

    env = yaml.safe_load(COMPOSE.read_text())["services"]["kafbat-ui"]["environment"]
    pattern = env["KAFKA_CLUSTERS_0_SERDE_0_TOPICVALUESPATTERN"]
    names = [spec.name for spec in TopicsConfig().specs().values()]
    for prefix in ("rl.", "myjob.", "demo-20261125-113000.", "team.exp-3.", ""):
        for name in names:
            assert re.fullmatch(pattern, prefix + name), f"{prefix + name} is not decoded by the rlstream serde"
    for other in ("__consumer_offsets", "orders", "rl.prompts.bak", "myjob.prompts-retry", "myjob-prompts",
                  "rl.", "prompts2", "_schemas", "rl.prompts2"):  # fmt: skip
        assert not re.fullmatch(pattern, other), other
    docs = (REPO / "docs/how-to/deploy.md").read_text()
    (line,) = [x for x in docs.splitlines() if x.startswith("KAFKA_CLUSTERS_0_SERDE_0_TOPICVALUESPATTERN:")]
    assert yaml.safe_load(line)["KAFKA_CLUSTERS_0_SERDE_0_TOPICVALUESPATTERN"] == pattern


# ---- Dockerfile --------------------------------------------------------------------------------
def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()]
    return any(p and not p.startswith("#") and fnmatch.fnmatch(path, p) for p in patterns)


def base_images() -> dict[str, str]:
    """Stage name ('' for an unnamed one) -> the image it starts FROM."""
    stages = {}
    for op, arg in instructions():
        if op == "FROM":
            image, _, stage = arg.partition(" AS ")
            stages[stage.strip()] = image.strip()
    return stages


def test_dockerfile_bases_entrypoint_and_copy_sources():
    ins = instructions()
    stages = base_images()
    variant = next(a for op, a in ins if op == "ARG" and a.startswith("VARIANT="))
    assert variant == "VARIANT=cpu" and stages[""] == "base-${VARIANT}"
    for stage in ("base-cpu", "base-cuda"):
        image = stages[stage]
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", image) and not image.endswith(":latest"), image
    entry = json.loads(next(a for op, a in ins if op == "ENTRYPOINT"))
    assert entry[-1] == "rlstream" and entry[0] == "tini"
    for op, arg in ins:
        if op == "COPY":
            *sources, _dest = shlex.split(arg)
            for src in sources:
                assert (REPO / src).exists() and not dockerignored(src), f"COPY source {src} missing or ignored"
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in {p.rstrip("*") for p in packages}:
        assert (REPO / pkg).is_dir() and not dockerignored(pkg), f"package {pkg} is not in the build context"


def test_cuda_base_is_the_cuda_of_the_pinned_torch_wheel():
    """The cuda variant installs PyPI's torch at the pyproject pin; its CUDA (the installed torch's,
    when that is the same PyPI build) must be the base image's CUDA major.minor."""
    torch = pytest.importorskip("torch")
    hf = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    (pin,) = [r.removeprefix("torch==") for r in hf if r.startswith("torch==")]
    if torch.__version__.split("+")[0] != pin or torch.version.cuda is None:
        pytest.skip(f"the installed torch {torch.__version__} is not PyPI's CUDA build of torch=={pin}")
    m = re.fullmatch(r"nvidia/cuda:(\d+\.\d+)\.\d+-[\w-]*runtime-ubuntu[\d.]+", base_images()["base-cuda"])
    assert m, base_images()["base-cuda"]
    cuda = ".".join(torch.version.cuda.split(".")[:2])
    assert m.group(1) == cuda, f"base-cuda is CUDA {m.group(1)}, torch=={pin} from PyPI is built for CUDA {cuda}"


def test_dockerfile_requirement_list_comes_from_pyproject(tmp_path):
    packaging = pytest.importorskip("packaging.requirements")
    run = next(a for op, a in instructions() if op == "RUN" and "tomllib" in a)
    code = re.search(r"python -c '([^']*)'", run).group(1)
    extras = next(a for op, a in instructions() if op == "ARG" and a.startswith("EXTRAS=")).split("=", 1)[1]
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, "EXTRAS": extras}, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    names = {packaging.Requirement(line).name for line in proc.stdout.splitlines()}
    assert {"confluent-kafka", "fastavro", "torch", "transformers", "math-verify", "matplotlib"} <= names
