"""The RocketMQ distribution a local broker runs: Maven Central jars resolved once into a cache, and Java.

The jars come from Maven Central, resolved once by `mvn dependency:copy-dependencies` into a cache
directory (`$TIMEWHEEL_CACHE_DIR` or `~/.cache/timewheel`, then `rocketmq-<version>/lib`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from forwarder.errors import LocalRocketMQError

__all__ = ["LEGACY_ROCKETMQ_VERSION", "ROCKETMQ_VERSION", "default_cache_dir", "ensure_distribution", "find_java"]

#: The Apache RocketMQ release a local broker runs unless told otherwise (jars are cached per version).
ROCKETMQ_VERSION = "5.3.3"
#: The 4.x release the conformance suite also runs against: the newest 4.9 on Maven Central (4.9.8 is
#: tagged in the source but its jars were never published there). Its servers run on Java 17 as they are.
LEGACY_ROCKETMQ_VERSION = "4.9.7"

_CACHE_ENV = "TIMEWHEEL_CACHE_DIR"
# Pinned so that the resolution does not depend on whatever plugin version Maven defaults to.
_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
_DOWNLOAD_TIMEOUT_S = 1800.0

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>timewheel.local</groupId>
  <artifactId>rocketmq-distribution</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.rocketmq</groupId>
      <artifactId>rocketmq-broker</artifactId>
      <version>{version}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.rocketmq</groupId>
      <artifactId>rocketmq-namesrv</artifactId>
      <version>{version}</version>
    </dependency>
  </dependencies>
</project>
"""


def default_cache_dir() -> Path:
    """Return the cache root: `$TIMEWHEEL_CACHE_DIR`, else `~/.cache/timewheel`."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "timewheel"


def ensure_distribution(
    cache_dir: Path | None = None, version: str = ROCKETMQ_VERSION, timeout: float = _DOWNLOAD_TIMEOUT_S
) -> Path:
    """Return the `lib/` folder of RocketMQ `version`, downloading it with Maven the first time."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    home = root / f"rocketmq-{version}"
    lib = home / "lib"
    if _is_complete(lib, version):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise LocalRocketMQError(
            f"mvn (Apache Maven) is not on PATH: install it (e.g. `apt-get install maven`) so the "
            f"RocketMQ {version} jars can be fetched once into {lib}"
        )
    home.mkdir(parents=True, exist_ok=True)
    # Resolve into a fresh folder and rename it into place only when complete: a killed or failed
    # download never leaves a half cache, and two concurrent downloads cannot mix their jars.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=home))
    log = home / "download.log"
    try:
        (staging / "pom.xml").write_text(_POM.format(version=version), encoding="utf-8")
        cmd = [
            mvn,
            "-B",
            "-f",
            str(staging / "pom.xml"),
            f"{_DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging / 'lib'}",
        ]
        try:
            with log.open("wb") as out:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise LocalRocketMQError(
                f"downloading the RocketMQ {version} jars took over {timeout:.0f} s: check access to "
                f"Maven Central (log: {log})"
            ) from e
        if proc.returncode != 0 or not _is_complete(staging / "lib", version):
            raise LocalRocketMQError(
                f"downloading the RocketMQ {version} jars with mvn failed ({_last_error_line(log)}): "
                f"check access to Maven Central, then retry (log: {log})"
            )
        try:
            os.rename(staging / "lib", lib)
        except OSError:
            # Another process completed the same download first; its copy is as good as ours.
            if not _is_complete(lib, version):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return lib


def _is_complete(lib: Path, version: str) -> bool:
    """Tell whether `lib` holds a finished resolution (the rename is the last step of one)."""
    return (lib / f"rocketmq-broker-{version}.jar").is_file() and (lib / f"rocketmq-namesrv-{version}.jar").is_file()


def _last_error_line(log: Path) -> str:
    """Return the most telling line of a Maven log: its first [ERROR] line, or its last line."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [ln.strip() for ln in lines if ln.startswith("[ERROR]") and ln.strip() != "[ERROR]"]
    if errors:
        return errors[0][:300]
    return lines[-1].strip()[:300] if lines else "no output"


def find_java() -> str:
    """Return the java executable ($JAVA_HOME first, then PATH), checking it is Java 11 or newer."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home) / "bin" / "java" if java_home else None
    java = str(candidate) if candidate is not None and candidate.is_file() else shutil.which("java")
    if java is None:
        raise LocalRocketMQError(
            "java is not on PATH: install a Java 17 runtime (e.g. `apt-get install openjdk-17-jre-headless`) "
            "to run the local RocketMQ"
        )
    major = _java_major(java)
    if major is not None and major < 11:
        raise LocalRocketMQError(f"{java} is Java {major}; the local RocketMQ needs Java 11 or newer (17 preferred)")
    return java


_JAVA_MAJORS: dict[str, int | None] = {}


def _java_major(java: str) -> int | None:
    """Return the major version of `java` (None when it cannot be told), cached per executable."""
    if java not in _JAVA_MAJORS:
        try:
            out = subprocess.run([java, "-version"], capture_output=True, timeout=30, check=False).stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LocalRocketMQError(f"cannot run {java} -version ({e}): fix the Java installation") from e
        m = re.search(rb'version "(\d+)(?:\.(\d+))?', out)
        major = None if m is None else int(m.group(1))
        if major == 1 and m is not None and m.group(2):  # "1.8.0_x" is Java 8
            major = int(m.group(2))
        _JAVA_MAJORS[java] = major
    return _JAVA_MAJORS[java]
