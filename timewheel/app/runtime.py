"""What the running process is made of, for whoever operates it: which hot paths run compiled, and
its threads named for the operating system (`top -H`, `ps -L`, `/proc/PID/task/*/comm`).

The three hot loops (the record check, the ingest walk, the send-batch cut) are C extensions built
by `pip install` when a C compiler is there; without one the same verdicts come from Python at
several times the CPU per message. A deployment that lost them says so at start and in `status`.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

__all__ = ["hot_paths", "log_hot_paths", "name_os_threads", "os_thread_name"]

log = logging.getLogger("timewheel.app.runtime")

#: the kernel keeps 15 bytes of a thread's name
_COMM_BYTES = 15
_PREFIXES = (("timewheel-", "tw-"), ("ingest-pull-", "tw-in-"))


def hot_paths() -> dict[str, bool]:
    """Whether each hot loop runs compiled (False: its pure-Python fallback)."""
    from forwarder import _ingest_pass, record_batches
    from forwarder.rocketmq import codec
    from storage import record_reader

    return {"record_scan": record_reader.COMPILED, "ingest_walk": _ingest_pass.COMPILED,
            "record_cut": record_batches.COMPILED, "uniq_key": codec.COMPILED_IDS}


def log_hot_paths() -> dict[str, bool]:
    """Say at start whether the hot loops are compiled (a warning naming the missing ones); return them."""
    paths = hot_paths()
    missing = sorted(k for k, ok in paths.items() if not ok)
    if missing:
        log.warning("hot paths in pure Python (not built at install, no C compiler?): %s; the engine needs "
                    "several times the CPU per message. Reinstall with a C compiler to build them.",
                    ", ".join(missing))
    else:
        log.info("hot paths compiled: %s", ", ".join(sorted(paths)))
    return paths


def os_thread_name(name: str) -> str:
    """The operating system's name for a Python thread: the project's prefix shortened, 15 bytes."""
    for long, short in _PREFIXES:
        if name.startswith(long):
            name = short + name[len(long):]
            break
    return name.encode("ascii", "replace")[:_COMM_BYTES].decode("ascii")


#: threads already named, by native id, with the name they were given
_named: dict[int, str] = {}
_named_lock = threading.Lock()


def name_os_threads(task_dir: Path = Path("/proc/self/task")) -> int:
    """Give every live Python thread of this process its name for the operating system (Linux: a
    thread may rename another of its own process through /proc); returns how many were named now.
    Cheap when called again: only threads not seen before are written."""
    if not task_dir.is_dir():
        return 0
    named = 0
    with _named_lock:
        # not the main thread: its name is the process's own (`ps`, `top`), which stays as started
        main = threading.main_thread()
        alive = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None and t is not main}
        for tid in [t for t in _named if t not in alive]:
            del _named[tid]  # ended: a new thread may get its id
        for tid, name in alive.items():
            if _named.get(tid) == name:
                continue
            try:
                (task_dir / str(tid) / "comm").write_text(os_thread_name(name))
            except OSError:  # ended meanwhile, or a kernel without it: the name is only a convenience
                pass
            _named[tid] = name
            named += 1
    return named
