"""The ZooKeeper distribution a local server runs: Maven Central jars resolved once into a cache, and Java.

`org.apache.zookeeper:zookeeper` and its runtime dependencies (zookeeper-jute, netty, slf4j,
metrics-core, slf4j-simple, ...) are resolved once by `mvn dependency:copy-dependencies` into the same cache root as
the local RocketMQ (`$TIMEWHEEL_CACHE_DIR` or `~/.cache/timewheel`), under `zookeeper-<version>/lib`.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from coordination.errors import LocalZooKeeperError

__all__ = ["ZOOKEEPER_VERSION", "ensure_zookeeper", "find_java"]

#: The Apache ZooKeeper release every local server runs (its jars are cached per version).
ZOOKEEPER_VERSION = "3.9.3"

_CACHE_ENV = "TIMEWHEEL_CACHE_DIR"
_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
_DOWNLOAD_TIMEOUT_S = 900.0

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>timewheel.local</groupId>
  <artifactId>zookeeper-distribution</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.zookeeper</groupId>
      <artifactId>zookeeper</artifactId>
      <version>{version}</version>
    </dependency>
    <!-- optional in ZooKeeper's pom, needed by a server: its metrics and a logger -->
    <dependency>
      <groupId>io.dropwizard.metrics</groupId>
      <artifactId>metrics-core</artifactId>
      <version>4.1.12.1</version>
    </dependency>
    <dependency>
      <groupId>org.xerial.snappy</groupId>
      <artifactId>snappy-java</artifactId>
      <version>1.1.10.5</version>
    </dependency>
    <dependency>
      <groupId>org.slf4j</groupId>
      <artifactId>slf4j-simple</artifactId>
      <version>1.7.30</version>
    </dependency>
  </dependencies>
</project>
"""


def _cache_root() -> Path:
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "timewheel"


def ensure_zookeeper(cache_dir: Path | None = None, version: str = ZOOKEEPER_VERSION,
                     timeout: float = _DOWNLOAD_TIMEOUT_S) -> Path:
    """Return the `lib/` folder of ZooKeeper `version`, downloading it with Maven the first time."""
    home = (Path(cache_dir) if cache_dir is not None else _cache_root()) / f"zookeeper-{version}"
    lib = home / "lib"
    if _is_complete(lib, version):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise LocalZooKeeperError(f"mvn (Apache Maven) is not on PATH: install it (e.g. `apt-get install maven`) so "
                                  f"the ZooKeeper {version} jars can be fetched once into {lib}")
    home.mkdir(parents=True, exist_ok=True)
    # Resolve into a fresh folder and rename it into place only when complete: a killed download
    # never leaves a half cache, and two concurrent downloads cannot mix their jars.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=home))
    log = home / "download.log"
    try:
        (staging / "pom.xml").write_text(_POM.format(version=version), encoding="utf-8")
        cmd = [mvn, "-B", "-f", str(staging / "pom.xml"), f"{_DEPENDENCY_PLUGIN}:copy-dependencies",
               "-DincludeScope=runtime", f"-DoutputDirectory={staging / 'lib'}"]
        try:
            with log.open("wb") as out:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise LocalZooKeeperError(f"downloading the ZooKeeper {version} jars took over {timeout:.0f} s: check "
                                      f"access to Maven Central (log: {log})") from e
        if proc.returncode != 0 or not _is_complete(staging / "lib", version):
            raise LocalZooKeeperError(f"downloading the ZooKeeper {version} jars with mvn failed: check access to "
                                      f"Maven Central, then retry (log: {log})")
        try:
            os.rename(staging / "lib", lib)
        except OSError:
            if not _is_complete(lib, version):  # another process finished the same download first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return lib


def _is_complete(lib: Path, version: str) -> bool:
    """Tell whether `lib` holds a finished resolution (the rename is the last step of one)."""
    return all((lib / name).is_file() for name in (f"zookeeper-{version}.jar", f"zookeeper-jute-{version}.jar",
                                                    "metrics-core-4.1.12.1.jar", "slf4j-simple-1.7.30.jar"))


def find_java() -> str:
    """Return the java executable ($JAVA_HOME first, then PATH), checking it is Java 11 or newer."""
    home = os.environ.get("JAVA_HOME")
    candidate = Path(home) / "bin" / "java" if home else None
    java = str(candidate) if candidate is not None and candidate.is_file() else shutil.which("java")
    if java is None:
        raise LocalZooKeeperError("java is not on PATH: install a Java 17 runtime (e.g. `apt-get install "
                                  "openjdk-17-jre-headless`) to run the local ZooKeeper")
    try:
        out = subprocess.run([java, "-version"], capture_output=True, timeout=30, check=False).stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LocalZooKeeperError(f"cannot run {java} -version ({e}): fix the Java installation") from e
    m = re.search(rb'version "(\d+)', out)
    if m is not None and int(m.group(1)) < 11:
        raise LocalZooKeeperError(f"{java} is Java {m.group(1).decode()}; the local ZooKeeper needs Java 11 or newer")
    return java
