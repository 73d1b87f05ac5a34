"""Declares the optional C++ extension: the CPU kernels of the hadw:: ops (csrc/).

Everything else about the package (name, version, dependencies) is in pyproject.toml.

The kernels take their constants (metric order, option codes, clamps) from the
package's tables (the modules that hadw_kernels/backends/cpp_constants.py names) and
their declarations from the ops' signatures (hadw_kernels/ops/signatures.py): before
compiling, this file writes them into build/generated/hadw_config.h and
build/generated/kernels.h
(hadw_kernels/backends/cpp_constants.py, cpp_declarations.py), which csrc/ includes.

The extension is optional: without torch at build time, without a C++ compiler, or if
compiling fails, the install still succeeds, says why on stderr, and the "torch"
backend serves the CPU. HADW_BUILD_CPP chooses: "auto" (default) builds when it can,
"1" makes any failure to build an error (CI), "0" skips the extension.
See docs/architecture.md, "C++: building".
"""

from __future__ import annotations

import importlib
import os
import runpy
import shlex
import shutil
import sys
import sysconfig
import types

from setuptools import setup

EXTENSION_NAME = "hadw_kernels._cpu_kernels"
ROOT = os.path.dirname(os.path.abspath(__file__))
SOURCES = ["csrc/module.cpp", "csrc/surrogate.cpp", "csrc/linear_logprob.cpp"]
GENERATED_DIR = os.path.join(ROOT, "build", "generated")
# -fopenmp: ATen's parallel_for is a header template; without it the kernels would run
# on one thread. -g0: Python's CFLAGS carry -g, which doubles the compile time of the
# ATen headers and gives a 6 MB module. No -march: csrc/tile_math.h compiles its loops
# for AVX-512, AVX2 and the x86-64 baseline and picks one when the module loads, so a
# wheel built here runs on any x86-64 CPU. -fno-trapping-math: nothing here reads or
# traps on floating-point exception flags, and without it GCC vectorises no loop with a
# float compare and select (exp's range clamps) for AVX2, which has no masked multiply:
# they ran scalar. It changes no result.
COMPILE_ARGS = ["-O3", "-g0", "-fopenmp", "-fno-trapping-math"]
LINK_ARGS = ["-fopenmp"]
MODE = os.environ.get("HADW_BUILD_CPP", "auto")


def _say(message: str) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nhadw-kernels: {message}\n{bar}\n", file=sys.stderr)


def _skip(reason: str) -> tuple[list, dict]:
    if MODE == "1":
        raise SystemExit(f"hadw-kernels: HADW_BUILD_CPP=1 but the C++ extension cannot be built: {reason}")
    _say(
        f"the C++ CPU kernels are NOT built: {reason}. The package works without them "
        "(the 'torch' backend runs on the CPU). To build them, see docs/architecture.md, 'C++: building'."
    )
    return [], {}


def _compiler() -> str | None:
    command = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    return shutil.which(shlex.split(command)[0])


def _package_file(*parts: str) -> dict:
    return runpy.run_path(os.path.join(ROOT, "hadw_kernels", *parts))


def _package_module(name: str):
    """hadw_kernels/<name>.py (``name`` dotted: ``tables.metrics``) imported under a stand-in package, so that its relative
    imports resolve without running hadw_kernels/__init__.py, which imports the whole
    library (and the extension being built)."""
    stand_in = "_hadw_kernels_tables"
    if stand_in not in sys.modules:
        package = types.ModuleType(stand_in)
        package.__path__ = [os.path.join(ROOT, "hadw_kernels")]
        sys.modules[stand_in] = package
    return importlib.import_module(f"{stand_in}.{name}")


def generate_headers(directory: str = GENERATED_DIR) -> list[str]:
    """Writes hadw_config.h (from the package's tables) and kernels.h (from the ops'
    signatures) into ``directory``; returns their paths."""
    config_header = _package_file("backends", "cpp_constants.py")
    declarations = _package_file("backends", "cpp_declarations.py")
    return [
        _write_if_changed(directory, config_header["HEADER_NAME"],
                          config_header["header"](_package_module)),
        _write_if_changed(directory, declarations["HEADER_NAME"],
                          declarations["header"](_package_file("ops", "signatures.py")["SIGNATURES"])),
    ]


def _write_if_changed(directory: str, name: str, text: str) -> str:
    """Only a changed text is written, so an unchanged header does not trigger a rebuild."""
    path = os.path.join(directory, name)
    os.makedirs(directory, exist_ok=True)
    try:
        with open(path) as existing:
            if existing.read() == text:
                return path
    except FileNotFoundError:
        pass
    with open(path, "w") as header:
        header.write(text)
    return path


def _extensions() -> tuple[list, dict]:
    if MODE == "0":
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError as error:
        return _skip(
            f"torch is not importable at build time ({error}); with pip, build with "
            "--no-build-isolation from an environment that has torch"
        )
    if _compiler() is None:
        return _skip("no C++ compiler found (set CXX, or install g++)")

    class OptionalBuildExtension(BuildExtension):
        """Turns a failed build into a warning unless HADW_BUILD_CPP=1."""

        def run(self):
            try:
                super().run()
            except Exception as error:  # compiler checks, compile and link errors share no base
                if MODE == "1":
                    raise
                _say(
                    f"building the C++ CPU kernels FAILED ({type(error).__name__}: {error}); "
                    "installing without them, the 'torch' backend runs on the CPU. "
                    "Set HADW_BUILD_CPP=1 to make this an error."
                )
                # Later steps (in-place copy, wheel contents) must not look for the module.
                self.extensions = []
                self.distribution.ext_modules = []

    headers = generate_headers()
    extension = CppExtension(
        EXTENSION_NAME,
        SOURCES,
        include_dirs=[GENERATED_DIR],
        depends=["csrc/scratch_memory.h", "csrc/tile_math.h", "csrc/token_math.h", *headers],
        extra_compile_args={"cxx": COMPILE_ARGS},
        extra_link_args=LINK_ARGS,
        py_limited_api=True,
    )
    return [extension], {"build_ext": OptionalBuildExtension}


extensions, commands = _extensions()
setup(
    ext_modules=extensions,
    cmdclass=commands,
    # The module uses only CPython's stable ABI: one wheel serves every CPython >= 3.10.
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if extensions else {},
)
