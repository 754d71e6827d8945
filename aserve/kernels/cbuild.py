"""Builds aserve's C kernels on first use and caches the shared objects.

Each kernel is one C file shipped with the package, compiled with the system's C
compiler (``gcc -O3 -march=native``, no Python or torch headers; 0.1 to 9 s a kernel on
a Zen 1 core, the decode attention's specialised loops being the slowest) into
``ASERVE_CACHE_DIR/kernels``, keyed by the source, the flags and this CPU, and loaded
with ctypes. :func:`build_ahead` compiles one on a caller's thread while it does other
work (a worker builds its two slowest that way). Where there is no compiler, or the
build fails, :func:`build` returns None and the caller keeps its plain-torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger("aserve.kernels")

FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fPIC", "-shared", "-fopenmp",
         # Lets gcc vectorise float32 dot products and sums (reassociation only: inf and
         # NaN keep their meaning).
         "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math")


def cpu_key() -> str:
    """The CPU's model and instruction-set flags: a VM may hide flags of the same model,
    and code built with ``-march=native`` for more flags would fault."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return model + flags or platform.processor()


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str] | None:
    """The instruction-set flags of this x86 CPU, from ``/proc/cpuinfo`` (or the text
    given); None where they cannot be read (no ``flags`` line: not x86, or no /proc)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return None if line is None else frozenset(line.split(":", 1)[1].split())


def build_ahead(source_path: Path, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Build what :func:`build` would, now, saying nothing: for a thread that compiles a
    library while the caller does other work (``aserve.worker.worker``). Where there is
    no compiler, the cache cannot be written or the build fails, nothing is built, and
    the later :func:`build` tries again and logs why."""
    try:
        build(source_path, cache_dir, "", extra_flags, quiet=True)
    except OSError:
        pass


def build(source_path: Path, cache_dir: Path, what: str, extra_flags: tuple[str, ...] = (), *,
          quiet: bool = False) -> Path | None:
    """The shared object built from ``source_path`` (built now unless cached), or None
    (logged unless ``quiet``, naming ``what`` falls back) without a compiler or when the
    build fails. ``extra_flags`` follow ``FLAGS`` (a test builds an AVX2-only form with
    ``-mno-avx512f``). Raises OSError when the cache directory cannot be written."""
    compiler = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if compiler is None:
        if not quiet:
            logger.warning("no C compiler found: %s uses the slower plain-torch path", what)
        return None
    # The key covers the files beside the source: the kernels share cpu_kernels.h, and
    # cpu_llama_decode.c compiles the others into its library.
    siblings = sorted(p for p in source_path.parent.iterdir() if p.suffix in (".c", ".h") and p != source_path)
    source = source_path.read_bytes() + b"".join(p.read_bytes() for p in siblings)
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(source + " ".join(flags).encode() + cpu_key().encode()).hexdigest()[:16]
    target = cache_dir / f"{source_path.stem}_{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The workers of a TP or DP server start together and want the same libraries: one
    # builds each while the others wait on its lock, then find it built (a first
    # `aserve generate --tp 2` on two Zen 1 cores: 29-32 -> 18 s). The lock file goes with
    # whoever leaves; a process that opened it just before may then build the library
    # again, which the rename below makes harmless, as it does where a file system
    # refuses the lock.
    lock_path = target.with_suffix(".lock")
    with open(lock_path, "w") as lock:
        with contextlib.suppress(OSError):
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.is_file():
                return target
            return _compile(compiler, flags, source_path, target, what, quiet)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock_path)


def _compile(compiler: str, flags: tuple[str, ...], source_path: Path, target: Path, what: str,
             quiet: bool) -> Path | None:
    # Build beside the target and rename, so no process loads a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, str(source_path), "-o", tmp, "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            if not quiet:
                logger.warning("building the C kernel for %s failed (plain-torch path used):\n%s", what,
                               result.stderr)
            return None
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(source_path: Path, cache_dir: Path, what: str,
                 extra_flags: tuple[str, ...] = (), available: str | None = None) -> ctypes.CDLL | None:
    """:func:`build`, then load the library; None (logged) where that cannot be done.
    ``available``: a function of the library (no arguments, returning int) that returns 0
    when the build lacks the instructions its kernel needs; the library is then None too."""
    try:
        path = build(source_path, cache_dir, what, extra_flags)
    except OSError as exc:
        logger.warning("could not build the C kernel for %s (plain-torch path used): %s", what, exc)
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    if available is not None:
        check = getattr(lib, available)
        check.restype = ctypes.c_int
        if not check():
            return None
    return lib
