"""The CPU extension (C++), built per instruction set with torch's extension loader.

What lives in it: the paged decode-attention kernel (decode on CPU is bound by memory traffic;
reading K/V straight from the cache blocks avoids the gather copy and its second read), the
causal prefill-attention kernel, the few-row matmul of a decode step's projections
(engine/linear.py), the decoder layers as one call (engine/cpu_stack.py; no interpreter
between the small ops of a decode step) and the KV transfer's block copies.

The same sources are compiled once per instruction set, each build a module of its own
(``pdserve_cpu_kernels_avx512vnni``, ``_avx512``, ``_avx2``), with explicit flags and never
``-march=native``: a build runs on any CPU that has its flags, so the AVX2 build is tested and
timed on AVX-512 machines too. At run time the best build this CPU can run is chosen (AVX-512
with VNNI, AVX-512, then AVX2 + FMA); without either, callers keep the torch paths, which are
faster than any generic loop. The VNNI build differs only in the int8-activation kernels'
dot products (quant_dot_cpu.cpp); the plain AVX-512 build stays for CPUs without VNNI
(Skylake-SP). ``PDSERVE_CPU_ISA`` (avx512vnni | avx512 | avx2 | torch) forces a choice and
``PDSERVE_NO_CPU_EXT=1`` means torch. An ARM build is one more ``Variant`` (NEON flags) and a
branch in csrc/simd.h. If the compiler fails, a warning is logged and the next choice is tried.

Processes that build (or load) one build folder at once take turns under an OS file lock
(``exclusive_build``), which also clears the lock file a killed build leaves behind. A build
folder is named by what the build depends on (``_build_key``), not by the checkout, so every
checkout of the same sources on a machine shares one build of each variant.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialized across processes
    fcntl = None

log = logging.getLogger("pdserve.kernels")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [
    "paged_decode_cpu.cpp",
    "paged_decode_int8_cpu.cpp",
    "prefill_attention_cpu.cpp",
    "skinny_gemm_cpu.cpp",
    "quant_gemm_cpu.cpp",
    "quant_dot_cpu.cpp",
    "decoder_stack_cpu.cpp",
    "kv_blocks_cpu.cpp",
    "bindings.cpp",
]


@dataclass(frozen=True)
class Variant:
    name: str
    cpu_flags: frozenset[str]  # /proc/cpuinfo flags the build's instructions need
    cflags: tuple[str, ...]


_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c")
_AVX512_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"})
VARIANTS = (  # fastest first
    # AVX-512 with the int8 dot product (vpdpbusd): the quantized kernels' integer path.
    Variant("avx512vnni", _AVX512_CPU | {"avx512_vnni"}, (*_AVX512_FLAGS, "-mavx512vnni")),
    Variant("avx512", _AVX512_CPU, _AVX512_FLAGS),
    Variant("avx2", frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
)
TORCH = "torch"  # no extension: the torch paths
CHOICES = (*(v.name for v in VARIANTS), TORCH)
_BY_NAME = {v.name: v for v in VARIANTS}

_lock = threading.RLock()
_modules: dict[str, object | None] = {TORCH: None}  # built (or failed) builds by name
_selected: str | None = None


def load(variant: str | None = None):
    """The compiled module of ``variant`` (default: the one chosen for this process), or None
    for the torch path: ``torch`` chosen, a CPU without the build's instructions, or a failed
    build. Cheap after the first call: the layers call it on every forward."""
    name = variant or _selected or selected_variant()
    try:
        return _modules[name]
    except KeyError:
        return _load_new(name)


def _load_new(name: str):
    if name not in _BY_NAME:
        raise ValueError(f"unknown CPU kernel variant {name!r}; expected one of {CHOICES}")
    with _lock:
        if name not in _modules:
            runnable = name in runnable_variants()
            _modules[name] = _build(_BY_NAME[name]) if runnable else None
    return _modules[name]


def selected_variant() -> str:
    """The variant ``load()`` returns: forced by ``use`` or the environment, else the best
    this CPU runs whose build succeeds, else ``torch``. Logged once."""
    global _selected
    with _lock:
        if _selected is None:
            _selected = _choose()
            info = describe()
            log.info(
                "CPU kernels: %s (CPU %s; instruction sets %s)",
                _selected, info["cpu_model"], info["cpu_isa"],
            )  # fmt: skip
    return _selected


def use(variant: str) -> None:
    """Force the variant for the rest of the process (benchmarks, tests); ``load()`` then
    returns its module, or None where this CPU cannot run it."""
    global _selected
    if variant not in CHOICES:
        raise ValueError(f"unknown CPU kernel variant {variant!r}; expected one of {CHOICES}")
    _selected = variant


def _choose() -> str:
    forced = os.environ.get("PDSERVE_CPU_ISA", "").strip().lower()
    if os.environ.get("PDSERVE_NO_CPU_EXT") == "1":
        forced = TORCH
    if forced and forced not in CHOICES:
        raise ValueError(f"PDSERVE_CPU_ISA={forced!r}: expected one of {CHOICES}")
    if forced == TORCH:
        return TORCH
    if forced and forced not in runnable_variants():
        log.warning("PDSERVE_CPU_ISA=%s: this CPU lacks its instructions; torch path", forced)
        return TORCH
    for name in [forced] if forced else runnable_variants():
        if _load_new(name) is not None:
            return name
    return TORCH


def build_all() -> list[str]:
    """Build every variant this CPU runs (install time, CI); returns those that built."""
    return [name for name in runnable_variants() if _load_new(name) is not None]


def runnable_variants() -> list[str]:
    """The builds whose instructions this CPU has, fastest first."""
    flags = cpu_flags()
    return [v.name for v in VARIANTS if v.cpu_flags <= flags]


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none): the one place
    the project reads it (the extension's variants, profiles' and benchmarks' CPU names)."""
    fields: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return fields
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags, as /proc/cpuinfo names them (torch's detected
    capability where there is no /proc/cpuinfo)."""
    info = cpuinfo()
    if "flags" in info or "Features" in info:  # x86 / ARM spelling
        return frozenset(info.get("flags", info.get("Features", "")).split())
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    return frozenset().union(*(v.cpu_flags for v in VARIANTS if v.name in capability.lower()))


def cpu_model() -> str:
    """The CPU's model name (``platform.processor()`` or the machine where /proc has none)."""
    info = cpuinfo()
    return info.get("model name") or platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The vector instruction sets this CPU has that the extension has builds for, e.g.
    ``avx512+avx2`` (``none`` without either)."""
    return "+".join(runnable_variants()) or "none"


def describe() -> dict:
    """What benchmarks record beside their figures: the CPU, its instruction sets, and the
    kernel variant this process uses."""
    return {
        "cpu_model": cpu_model(),
        "cpu_isa": cpu_isa(),
        "cpu_kernels": _selected or "(not chosen yet)",
    }


def _vector_math_flags() -> list[str]:
    """glibc's vector math library on x86-64 (vectorised expf in the softmax); the source falls
    back to scalar expf where it is absent."""
    is_glibc = platform.libc_ver()[0] == "glibc"
    return ["-lmvec"] if is_glibc and platform.machine() in ("x86_64", "AMD64") else []


def _compile_flags(variant: Variant) -> tuple[list[str], list[str]]:
    """The compiler's and the linker's flags for ``variant``'s build. Tuned for no CPU in
    particular: the build must run, and run well, on every CPU with the variant's flags."""
    cflags = ["-O3", "-mtune=generic", *variant.cflags, "-fopenmp"]
    return cflags, ["-fopenmp", *_vector_math_flags()]


def _build_key(variant: Variant) -> str:
    """What a build depends on: every file in csrc (headers too), the flags, and the Python,
    torch and compiler it is built with and for, down to the folders torch puts in the compile
    and link commands. Equal keys, equal modules and equal commands: two virtualenvs (a
    developer's and CI's) once shared a folder, and each load after the other's recompiled
    every object because ninja saw other include paths (2 minutes a variant on 2 cores)."""
    import hashlib
    import sysconfig

    import torch
    from torch.utils import cpp_extension

    digest = hashlib.sha1()
    for path in sorted(p for p in _CSRC.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    cflags, ldflags = _compile_flags(variant)
    toolchain = [
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        torch.__version__,
        torch.version.git_version,
        os.environ.get("CXX", ""),
        *cpp_extension.include_paths(),
        *cpp_extension.library_paths(),
        sysconfig.get_paths()["include"],
    ]
    digest.update(repr((cflags, ldflags, toolchain)).encode())
    return digest.hexdigest()[:16]


def _build_directory(variant: str) -> Path:
    """A build folder per variant and build key (``_build_key``), not per checkout: a fresh
    clone (CI, a second working tree) loads the module an earlier checkout of the same sources
    built instead of compiling it again (2 minutes a variant on 2 cores), while checkouts whose
    sources differ never share a folder, so none rebuilds another's objects or loads a module
    built from another's sources."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    path = Path(root) / "pdserve" / f"{variant}-{_build_key(_BY_NAME[variant])}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _staged_sources(build_directory: Path) -> list[Path]:
    """The sources as copied into ``build_directory`` (headers too), the copies compiled: the
    commands ninja records then name no checkout, so a second checkout's load finds the same
    commands and the objects up to date instead of compiling again. The folder's key covers
    the files' contents, so copies already there are these files; under ``exclusive_build``."""
    staged = build_directory / "src"
    if not staged.is_dir():
        tmp = build_directory / f"src.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(_CSRC, tmp)
        tmp.rename(staged)
    return [staged / name for name in _SOURCES]


def _build(variant: Variant):
    try:
        from torch.utils.cpp_extension import load as load_extension

        build_directory = _build_directory(variant.name)
        cflags, ldflags = _compile_flags(variant)
        with exclusive_build(build_directory):
            module = load_extension(
                name=f"pdserve_cpu_kernels_{variant.name}",
                sources=[str(path) for path in _staged_sources(build_directory)],
                build_directory=str(build_directory),
                extra_cflags=cflags,
                extra_ldflags=ldflags,
                verbose=False,
            )
    except Exception as e:  # noqa: BLE001  (no compiler, no headers: the torch path still works)
        log.warning("CPU extension (%s) unavailable (%s); using the torch path", variant.name, e)
        return None
    assert module.instruction_set == variant.name, "build flags and simd.h disagree"
    return module


# torch's lock in a build folder (torch.utils.file_baton.FileBaton): a file created with O_EXCL
# and kept open while a build runs, removed at its end. A build killed mid-way leaves it, and
# torch waits for it to go away, forever. Ours sits beside it and is never removed.
TORCH_LOCK_FILE = "lock"
BUILD_LOCK_FILE = "pdserve-build.lock"


@contextlib.contextmanager
def exclusive_build(build_directory: Path) -> Iterator[None]:
    """Hold ``build_directory`` alone while torch builds or loads there. The lock is an OS
    lock (flock) that the kernel drops when its process dies, so a killed build cannot leave
    it held; under it no other build of this folder runs, so a torch lock file found there
    that no live process has open was left by a killed build and is removed."""
    if fcntl is None:
        yield
        return
    with open(Path(build_directory) / BUILD_LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process's build in %s", build_directory)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            remove_stale_torch_lock(Path(build_directory))
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def remove_stale_torch_lock(build_directory: Path) -> bool:
    """Remove torch's lock file in ``build_directory`` unless a live process has it open (a
    build that does not take ``exclusive_build``'s lock, e.g. an older checkout's); True if
    it was removed. Call under ``exclusive_build``."""
    path = build_directory / TORCH_LOCK_FILE
    if not path.exists():
        return False
    holders = processes_with_open(path)
    if holders:
        log.warning("%s is held by process %s; torch waits for it", path, holders[0])
        return False
    log.warning("removing %s: left by a build that was killed", path)
    path.unlink(missing_ok=True)
    return True


def processes_with_open(path: Path) -> list[int]:
    """Ids of the processes that have ``path`` open (from /proc; none found without it)."""
    target = os.path.realpath(path)
    return [
        int(fd_dir.parent.name)
        for fd_dir in Path("/proc").glob("[0-9]*/fd")
        if target in _open_files(fd_dir)
    ]


def _open_files(fd_dir: Path) -> set[str]:
    """What a process's /proc/<pid>/fd entries point to (those still there and readable)."""
    try:
        fds = list(fd_dir.iterdir())
    except OSError:  # the process is gone, or not ours to read
        return set()
    files = set()
    for fd in fds:
        with contextlib.suppress(OSError):  # closed since the listing
            files.add(os.readlink(fd))
    return files
