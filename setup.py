"""Build the optional C extension for chained block hashing.

Everything else lives in pyproject.toml. The extension needs Debian's libxxhash-dev
(scripts/setup.sh installs it); when it cannot be built, installation still succeeds
and kvmesh.cache_store.hashing uses its pure-Python loop (same hashes, slower).
"""
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler or header missing
            print(f"warning: optional extension not built ({exc}); using pure-Python hashing", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: {ext.name} not built ({exc}); using pure-Python hashing", file=sys.stderr)


setup(
    ext_modules=[Extension("kvmesh.cache_store._chainhash", ["cache_store/_chainhash.c"], libraries=["xxhash"],
                           extra_compile_args=["-O3"])],
    cmdclass={"build_ext": OptionalBuildExt},
)
