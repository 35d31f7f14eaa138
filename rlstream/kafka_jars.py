"""Apache Kafka's own jars for this machine: the Java check and the classpath Maven resolves from
``infra/kafka/pom.xml`` (once, cached by the pom's hash). The local broker (``rlstream.broker``) and
Kafka's CLI tools (``rlstream.kafka_tools``) both run on them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

from pipeline.errors import BrokerError

REPO_ROOT = Path(__file__).resolve().parents[1]
POM = Path(os.environ.get("RLSTREAM_KAFKA_POM", REPO_ROOT / "infra" / "kafka" / "pom.xml"))
CACHE_DIR = Path(os.environ.get("RLSTREAM_CACHE", Path.home() / ".cache" / "rlstream"))


def java_version() -> int:
    """The major version of the ``java`` on PATH; BrokerError if there is none or it is below 17."""
    java = shutil.which("java")
    if not java:
        raise BrokerError(
            "java not found: the local broker needs Java 17+ (e.g. apt-get install openjdk-17-jre-headless)"
        )
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    try:
        ver = out.split('"')[1]
        major = int(ver.split(".")[0] if not ver.startswith("1.") else ver.split(".")[1])
    except (IndexError, ValueError):
        raise BrokerError(f"cannot read the Java version from: {out.strip()[:200]}") from None
    if major < 17:
        raise BrokerError(f"Kafka 4.x needs Java 17+, found {ver}")
    return major


def classpath(progress=print) -> str:
    """Resolve the broker's jars with Maven (once; cached by the pom's hash)."""
    if not POM.is_file():
        raise BrokerError(f"Kafka pom not found at {POM} (set RLSTREAM_KAFKA_POM)")
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:16]
    cp_file = CACHE_DIR / f"kafka-classpath-{digest}.txt"
    if cp_file.is_file():
        cp = cp_file.read_text().strip()
        if cp and all(Path(j).is_file() for j in cp.split(os.pathsep)):
            return cp
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError("mvn not found: the local broker resolves Kafka's jars with Maven (apt-get install maven)")
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    progress("resolving Kafka jars from Maven Central (first start only; cached in ~/.m2)...")
    t0 = time.monotonic()
    tmp = cp_file.with_suffix(f".{os.getpid()}.tmp")
    proc = subprocess.run(
        [mvn, "-q", "-B", "-f", str(POM), "dependency:build-classpath", f"-Dmdep.outputFile={tmp}"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0 or not tmp.is_file():
        raise BrokerError(f"Maven could not resolve Kafka's jars:\n{(proc.stdout + proc.stderr)[-3000:]}")
    tmp.replace(cp_file)
    progress(f"resolved Kafka jars in {time.monotonic() - t0:.1f}s")
    return cp_file.read_text().strip()
