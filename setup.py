"""The compiled parts, built by `pip install`; without a C compiler the install goes on and the
Python paths (same results, slower) run instead: `storage.record_reader.COMPILED` says which."""
from __future__ import annotations

import logging

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: every compiled module has a Python fallback."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler failure: install without it
            logging.warning("the compiled modules were not built (%s); the Python paths will run", e)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            logging.warning("%s was not built (%s); its Python path will run", ext.name, e)


def _extensions() -> list[Extension]:
    from Cython.Build import cythonize
    return cythonize([Extension(name, [name.replace(".", "/") + ".pyx"], extra_compile_args=["-O2"])
                      for name in ("storage._record_scan", "storage._record_header", "forwarder._ingest_walk", "forwarder._record_cut",
                                   "forwarder.rocketmq._uniq_key")],
                     compiler_directives={"language_level": 3}, quiet=True)


setup(ext_modules=_extensions(), cmdclass={"build_ext": OptionalBuildExt})
