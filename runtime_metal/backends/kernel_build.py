"""fuselm's CPU kernels (cpu_kernels.cpp) built once, at install, and found at run time without a compiler.

    python -m fuselm.runtime_metal.backends.kernel_build     # scripts/setup.sh runs it after installing fuselm

builds the kernels with torch.utils.cpp_extension into a persistent cache, `kernel_dir()`, under a
name keyed by the sources' hash, the build flags, torch's version and the Python ABI: a change to
any of them is a new name (the old one is never loaded), the same ones load what is there. One build
runs on every x86-64 CPU (each instruction set's kernels carry their own target and the choice is
made at run time, cpu_kernels.cpp), so the CPU is not part of the key.

`load()` imports the cached module directly (importlib: no compiler, no ninja, no rebuild check:
~30 ms). Only when it is missing does it build, saying so (~30 s, once); without a compiler it
returns None and says what the runtime does instead (f32 weights dequantized at load).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from fuselm import switches

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_kernels.cpp", HERE / "cpu_kernels_gemv.inc"]
# no -m flags: the baseline is x86-64; each kernel's `#pragma GCC target` enables its instruction set
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)  # the libgomp soname resolves to the copy torch loaded
_log = logging.getLogger("fuselm.runtime")


def kernel_dir() -> Path:
    """FUSELM_KERNEL_DIR, else $TORCH_EXTENSIONS_DIR/fuselm, else ~/.cache/fuselm/kernels (XDG_CACHE_HOME)."""
    ext = os.environ.get("TORCH_EXTENSIONS_DIR", "").strip()
    return switches.cache_folder("kernels", "FUSELM_KERNEL_DIR", Path(ext) / "fuselm" if ext else None)


def module_name() -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join([*CFLAGS, *LDFLAGS, torch.__version__, sys.implementation.cache_tag, platform.machine()]).encode())
    return f"fuselm_cpu_kernels_{h.hexdigest()[:16]}"


def library_path(directory: Path | None = None) -> Path:
    name = module_name()
    return (directory or kernel_dir()) / name / f"{name}{'.pyd' if sys.platform == 'win32' else '.so'}"


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(path.parent.name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def build(directory: Path | None = None, verbose: bool = False):
    """Compile the kernels into the cache; returns the module. Each build runs in its own temporary
    directory and moves the finished library into place (an atomic rename): a build killed mid-way
    leaves no partial library and no lock for later processes to wait on, and two processes building
    at once both succeed."""
    from torch.utils.cpp_extension import load as cpp_load

    path = library_path(directory)
    path.parent.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{path.parent.name}.build-", dir=path.parent.parent))
    try:
        module = cpp_load(name=path.parent.name, sources=[str(SOURCES[0])], build_directory=str(tmp),
                          extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), verbose=verbose)  # torch appends to them
        path.parent.mkdir(exist_ok=True)
        os.replace(tmp / path.name, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return module


def load(directory: Path | None = None):
    """The kernels' module: imported from the cache, else built there (with a compiler), else None."""
    path = library_path(directory)
    if path.exists():
        try:
            return _import(path)
        except ImportError as e:  # a damaged file, or a foreign ABI: rebuild
            _log.warning("fuselm: could not load the CPU kernels at %s (%s); rebuilding them", path, e)
            path.unlink(missing_ok=True)
    if compiler() is None:
        _log.warning("fuselm: no prebuilt CPU kernels in %s and no C++ compiler (%s) to build them: quantized "
                     "weights are dequantized to f32 at load (8x the memory of 4-bit weights, slower decode). "
                     "Fix: install one (apt install g++) and run `python -m fuselm.runtime_metal.backends.kernel_build`",
                     path.parent.parent, os.environ.get("CXX", "c++"))
        return None
    _log.warning("fuselm: building the CPU kernels for this install into %s (once, ~30 s; scripts/setup.sh does "
                 "this at install time)", path.parent)
    try:
        return build(directory)
    except Exception as e:  # noqa: BLE001 - any build failure means the fallback path
        _log.warning("fuselm: could not build the CPU kernels (%s); quantized weights are dequantized to f32 at load",
                     str(e)[-500:])
        return None


def main() -> None:
    """Build the kernels into the cache unless they are there (-v: the compiler's output)."""
    t = time.perf_counter()
    if compiler() is None and not library_path().exists():
        raise SystemExit(f"no C++ compiler ({os.environ.get('CXX', 'c++')}): fuselm will dequantize quantized weights "
                         "to f32 at load. Install one (apt install g++) and run this again.")
    module = _import(library_path()) if library_path().exists() else build(verbose="-v" in sys.argv)
    isas = [name for i, name in enumerate(("scalar", "avx2", "avx512vnni")) if module.isa_supported(i)]
    print(f"fuselm CPU kernels: {library_path()} ({time.perf_counter() - t:.1f} s); this CPU runs: {', '.join(isas)}")


if __name__ == "__main__":
    main()
