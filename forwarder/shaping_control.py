"""Which traffic rules are in force, and keeping them so: config file, admin API, meta store.

Three places hold rules:
- the config file's `[shaping]` section, watched (watchfiles, in a thread): an edit applies within
  a second, without a restart;
- the admin API (`PUT /shaping`), which replaces the rules at once;
- the meta store, where the last accepted rules are persisted (document `shaping_rules`, with the
  fingerprint of the file's `[shaping]` section as it was then), so that a restart keeps them.

Precedence: the latest accepted change wins, whether it came from the file or the admin API. At
start the persisted rules are in force, unless the file's `[shaping]` section differs from the one
recorded with them (the file was edited while the service was down): then the file's rules win. An
edit of the file that leaves `[shaping]` unchanged does not undo rules set through the admin API.

A rule set is validated whole: an invalid one (from the file or the API) is refused with a message
naming the key, and the rules in force stay.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import tomllib
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from forwarder.shaping import TrafficShaper
from forwarder.shaping_rules import ShapingRules, parse_rules, rules_digest
from timewheel.errors import ConfigError

log = logging.getLogger("timewheel.shaping")

RULES_DOCUMENT = "shaping_rules"
_DEBOUNCE_MS = 200
_POLL_SECONDS = 0.5


class DocumentStore(Protocol):
    """Where the accepted rules are persisted (the engine's meta store)."""

    def get_document(self, name: str) -> Any | None:
        """The JSON document stored under `name`, or None."""
        ...

    def put_document(self, name: str, value: Any) -> None:
        """Store a JSON document under `name`."""
        ...


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class ShapingControl:
    """Owns the TrafficShaper of a running service and the rules it enforces."""

    def __init__(self, file_rules: Mapping[str, Any] | None, *, config_path: Path | None = None,
                 max_grant: int = 256, now_ms: Callable[[], int] = _wall_ms) -> None:
        """Validate the file's rules (ConfigError if invalid) and build a paused shaper with them."""
        self._file_raw: dict[str, Any] = dict(file_rules or {})
        rules = parse_rules(self._file_raw)
        self._file_digest = rules_digest(self._file_raw)
        self.config_path = Path(config_path) if config_path is not None else None
        self.shaper = TrafficShaper(rules, max_grant=max_grant, paused=True)
        self._now_ms = now_ms
        self._documents: DocumentStore | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status: dict[str, Any] = {"source": "file", "applied_ms": None, "last_error": None,
                                        "config_path": str(self.config_path) if self.config_path else None}

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self, documents: DocumentStore | None = None, *, watch: bool = True) -> "ShapingControl":
        """Settle the rules in force (persisted or file), let the shaper grant, and watch the file."""
        self._documents = documents
        with self._lock:
            self._settle()
        self.shaper.resume()
        if self.config_path is not None and watch:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="timewheel-shaping-watch", daemon=True)
            self._thread.start()
            self.reload_file()  # an edit between reading the settings and watching is not missed
        return self

    def stop(self) -> None:
        """Stop watching; rules stay as they are."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self._documents = None

    # ---- changes ------------------------------------------------------------------------------------

    @property
    def rules(self) -> dict[str, Any]:
        """The rule document in force, as accepted."""
        return dict(self.shaper.rules.raw)

    def status(self) -> dict[str, Any]:
        """Where the rules in force came from, when, and the last refusal."""
        with self._lock:
            return {**self._status, "digest": self.shaper.rules.digest}

    def replace(self, raw: Mapping[str, Any]) -> dict[str, Any]:
        """Validate and apply new rules (the admin API); ConfigError leaves the old ones in force."""
        try:
            rules = parse_rules(raw)
        except ConfigError as e:
            with self._lock:
                self._status["last_error"] = f"admin: {e}"
            raise
        with self._lock:
            self._apply(rules, "admin")
        log.info("traffic rules replaced through the admin API (%s)", rules.digest)
        return dict(rules.raw)

    def reload_file(self) -> bool:
        """Apply the file's `[shaping]` section if it changed; False if unchanged or refused."""
        if self.config_path is None:
            return False
        try:
            try:
                doc = tomllib.loads(self.config_path.read_text(encoding="utf-8"))
            except UnicodeDecodeError as e:  # TOML is UTF-8 by definition; not the locale's encoding
                raise ConfigError(f"not UTF-8 text (byte {e.start}): save it as UTF-8") from e
            raw = doc.get("shaping", {})
            if not isinstance(raw, dict):
                raise ConfigError("[shaping] must be a table")
            digest = rules_digest(raw)
            if digest == self._file_digest:
                return False
            rules = parse_rules(raw)
        except (OSError, tomllib.TOMLDecodeError, ConfigError) as e:
            log.error("traffic rules in %s refused, the rules in force stay: %s", self.config_path, e)
            with self._lock:
                self._status["last_error"] = f"{self.config_path}: {e}"
            return False
        with self._lock:
            self._file_raw, self._file_digest = raw, digest
            self._apply(rules, "file")
        log.info("traffic rules reloaded from %s (%s)", self.config_path, rules.digest)
        return True

    # ---- inside -------------------------------------------------------------------------------------

    def _settle(self) -> None:
        """At start: persisted rules if the file's section is as it was when they were stored."""
        doc = self._documents.get_document(RULES_DOCUMENT) if self._documents is not None else None
        if isinstance(doc, dict) and doc.get("file_digest") == self._file_digest:
            try:
                rules = parse_rules(doc.get("rules"))
            except ConfigError as e:
                log.warning("persisted traffic rules are invalid, using the config file's: %s", e)
            else:
                self.shaper.apply(rules)
                self._status.update(source=f"{doc.get('source', 'admin')} (persisted)",
                                    applied_ms=doc.get("applied_ms"))
                log.info("traffic rules from the meta store (%s, set by %s)", rules.digest, doc.get("source"))
                return
        elif doc is not None:
            log.info("the config file's [shaping] changed since the rules were persisted: the file's rules apply")
        self._apply(parse_rules(self._file_raw), "file")

    def _apply(self, rules: ShapingRules, source: str) -> None:
        """Put rules in force and persist them (under the lock)."""
        now = self._now_ms()
        self.shaper.apply(rules)
        self._status.update(source=source, applied_ms=now, last_error=None)
        if self._documents is not None:
            self._documents.put_document(RULES_DOCUMENT, {"rules": dict(rules.raw), "source": source,
                                                          "file_digest": self._file_digest, "applied_ms": now})

    def _watch(self) -> None:
        """Reload on every change of the config file; poll its mtime if the watcher cannot run."""
        assert self.config_path is not None
        name = self.config_path.name
        try:
            import watchfiles

            for _ in watchfiles.watch(self.config_path.parent, watch_filter=lambda _c, p: os.path.basename(p) == name,
                                      debounce=_DEBOUNCE_MS, step=50, stop_event=self._stop, recursive=False,
                                      raise_interrupt=False, rust_timeout=1000):
                self._reload_logged()
            return
        except Exception:
            if self._stop.is_set():
                return
            log.exception("cannot watch %s; polling it every %.1fs instead", self.config_path, _POLL_SECONDS)
        last = None
        while not self._stop.wait(_POLL_SECONDS):
            try:
                st = self.config_path.stat()
                stamp = (st.st_mtime_ns, st.st_size)
            except OSError:
                continue
            if stamp != last:
                last = stamp
                self._reload_logged()

    def _reload_logged(self) -> None:
        try:
            self.reload_file()
        except Exception:
            log.exception("reloading traffic rules from %s failed", self.config_path)
