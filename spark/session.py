"""The SparkSession the jobs run in, with the timewheel sources registered."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
#: driver JVM options for jobs whose per-record work runs in Python workers (the audit): that JVM
#: only plans and moves small tables, so the C2 compiler and a parallel collector cost more CPU
#: than they save. Measured on local[2], 2M records: the JVM's CPU seconds for session start and
#: the first audit went from 40 to 21, with the same results.
LIGHT_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


# The driver JVMs this process started, and whether they are to be stopped: PySpark hands its gateway
# process over only once the JVM is up, too late for a command stopped while its session starts.
_driver_jvms: list[subprocess.Popen[bytes]] = []
_jvms_lock = threading.Lock()
_stopping = threading.Event()


class _DriverJvm(subprocess.Popen):
    """`subprocess.Popen` as PySpark's gateway launcher uses it, keeping the process to stop it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Start the process, and terminate it at once if `stop_driver_jvm` ran first."""
        super().__init__(*args, **kwargs)
        with _jvms_lock:
            _driver_jvms.append(self)
        if _stopping.is_set():
            self.terminate()


@contextmanager
def _kept_driver_jvm() -> Iterator[None]:
    """While PySpark may launch its gateway, launch it as a `_DriverJvm`."""
    from pyspark import java_gateway

    launcher = java_gateway.Popen
    setattr(java_gateway, "Popen", _DriverJvm)
    try:
        yield
    finally:
        setattr(java_gateway, "Popen", launcher)


def stop_driver_jvm(grace_s: float = 5.0) -> None:
    """Terminate the driver JVM this process started (SIGTERM: its shutdown hooks stop the SparkContext
    and remove its temporary files; SIGKILL after `grace_s`), also while `get_session` is still
    starting it: one it starts after this call is terminated as soon as it is started."""
    _stopping.set()
    with _jvms_lock:
        jvms = list(_driver_jvms)
    for jvm in jvms:
        if jvm.poll() is None:
            jvm.terminate()
            try:
                jvm.wait(grace_s)
            except subprocess.TimeoutExpired:
                jvm.kill()
                jvm.wait()


def register_sources(spark: SparkSession) -> None:
    """Make `format("timewheel")`, `format("timewheel_dispatch")` and `format("timewheel_audit")`
    available in a session."""
    from spark.audit_source import TimewheelAuditDataSource
    from spark.dispatch_source import TimewheelDispatchDataSource
    from spark.source import TimewheelDataSource

    spark.dataSource.register(TimewheelDataSource)
    spark.dataSource.register(TimewheelDispatchDataSource)
    spark.dataSource.register(TimewheelAuditDataSource)


def _local_cores(master: str) -> int:
    """Cores a local master runs tasks on: local, local[N], local[*], local[N,F]."""
    inside = master[master.find("[") + 1:master.find("]")] if "[" in master else "1"
    first = inside.split(",")[0].strip()
    return os.cpu_count() or 1 if first == "*" else max(1, int(first))


def get_session(master: str = DEFAULT_MASTER, app_name: str = "timewheel",
                conf: Mapping[str, str] | None = None, *, light_jvm: bool = False) -> SparkSession:
    """The active session (sources registered), or a new one on `master`.

    Workers run this interpreter (so they import `storage` and `spark` as the driver does), and
    times are UTC. On a cluster, install the project on every node (or ship it with
    `spark.submit.pyFiles`) and keep the data directory on a filesystem every node sees.
    `light_jvm` starts the driver JVM with LIGHT_JVM_OPTIONS (before any given in `conf`, so
    those win); it only matters when this call starts the JVM.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = (SparkSession.builder.master(master).appName(app_name)
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.ui.showConsoleProgress", "false"))
    conf = dict(conf or {})
    if light_jvm:
        given = conf.get("spark.driver.extraJavaOptions", "")
        conf["spark.driver.extraJavaOptions"] = f"{LIGHT_JVM_OPTIONS} {given}".strip()
    if master.startswith("local") and "spark.sql.shuffle.partitions" not in conf:
        # a few tasks per core: the default 200 makes every small stage cost seconds on one machine
        conf["spark.sql.shuffle.partitions"] = str(2 * _local_cores(master))
    for k, v in conf.items():
        builder = builder.config(k, v)
    with _kept_driver_jvm():
        spark = builder.getOrCreate()
    register_sources(spark)
    return spark
