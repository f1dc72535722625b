"""The native library (csrc/): its instruction-set variants, building and loading them, the code digest.

Each variant builds from the same sources with its own instruction-set flags (csrc/simd.h: the same bits from each)
into a torch.ops namespace of its own, so that all load side by side; the engine runs one, $MEDUSA_ISA's where set,
else the fastest this CPU runs.
"""

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from ..ggml_types import BLOCK_TYPES, TYPE_NAMES

CSRC = Path(__file__).parent.with_name("csrc")
SOURCES = [CSRC / name for name in ("linear.cpp", "kquants.cpp", "attention.cpp", "layer.cpp", "library.cpp")]
HEADERS = [CSRC / name for name in ("simd.h", "ops.h")]
# the native kernels' instruction-set variants (csrc/simd.h: the same bits from each), fastest first, and their flags
# (F16C, which widens a float16 cache, came with AVX2 on every CPU that has it)
VARIANTS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
            "avx2": ["-mavx2", "-mfma", "-mf16c"], "baseline": []}
VARIANT_ENV = "MEDUSA_ISA"  # forces a variant for the whole engine (one this CPU runs)
# each variant's ops, torch.ops.medusa_<variant>: torch resolves an op on first use, once load_native has loaded it
NAMESPACES = {isa: getattr(torch.ops, f"medusa_{isa}") for isa in VARIANTS}


def cpu_variants() -> list[str]:
    """The variants this CPU runs, fastest first (ATen's own reading of the CPU: AVX512 means F, BW, VL and DQ)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ["baseline"]
    capability = torch.backends.cpu.get_cpu_capability()
    return list(VARIANTS)[{"AVX512": 0, "AVX2": 1}.get(capability, 2):]


@functools.cache
def variant() -> str:
    """The variant the engine runs: $MEDUSA_ISA where set, else the fastest this CPU runs."""
    runnable = cpu_variants()
    forced = os.environ.get(VARIANT_ENV)
    if forced and forced not in runnable:
        raise ValueError(f"{VARIANT_ENV}={forced!r}: this CPU runs the variants {runnable}")
    return forced or runnable[0]


def native_build(isa: str | None = None) -> str | None:
    """Builds the medusa ops (linears, attention) of variant `isa` (None: the engine's, `variant()`), once per machine
    (cached under the project's cache directory), and loads them as torch.ops.medusa_<isa>. Returns None, or why they
    cannot be built here, in one line (no C++ compiler, a compiler that fails)."""
    return build_variant(isa or variant())


def build_directory(isa: str) -> Path:
    """Where a variant builds, per Python and torch version."""
    from ..config import cache_root

    tag = f"{sys.implementation.cache_tag}_torch{torch.__version__}"
    return cache_root() / "kernels" / f"medusa_kernels_{isa}_{tag}"


@functools.cache
def build_variant(isa: str) -> str | None:
    """native_build's work, once a process per variant: a namespace's ops register once (a second copy aborts)."""
    from torch.utils.cpp_extension import get_cxx_compiler, load

    if missing := [path.name for path in SOURCES + HEADERS if not path.is_file()]:
        return f"the native kernels' sources are missing from {CSRC}: {', '.join(missing)} (a broken install?)"
    if shutil.which(get_cxx_compiler()) is None:
        return f"no C++ compiler: {get_cxx_compiler()!r} is not on PATH (install g++, or set CXX)"
    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH: the pip package's, outside an activated venv
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    name, build = f"medusa_kernels_{isa}", build_directory(isa)
    if not (build / f"{name}.so").exists():
        print(f"medusa: building the native CPU kernels ({isa}) for this machine (once, about 30 s)", file=sys.stderr)
    build.mkdir(parents=True, exist_ok=True)
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]  # rebuilt when they change
    try:  # -Wno-psabi: vectors passed between the functions of one path, all inlined into it
        with open(build / "medusa.lock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)  # one build at a time, released by the OS when its process dies
            (build / "lock").unlink(missing_ok=True)  # torch's own, which a process killed mid-build leaves forever
            load(name, [str(source) for source in SOURCES], extra_cflags=[
                 "-O3", "-fopenmp", "-Wno-psabi", "-ffp-contract=off", "-fvisibility=hidden",
                 f"-DMEDUSA_OPS=medusa_{isa}", f"-DMEDUSA_HEADERS={headers}", *VARIANTS[isa]],
                 extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False)
    except Exception as error:  # the compiler's own output: its first error line says why
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else error)
        return f"the native kernels did not build: {first}"
    namespace = f"medusa_{isa}"
    torch.library.register_fake(f"{namespace}::linear")(lambda x, w: x.new_empty(x.shape[0], w.shape[0]))
    torch.library.register_fake(f"{namespace}::linear_blocks")(
        lambda x, codes, scales, bits: x.new_empty(x.shape[0], codes.shape[0]))
    torch.library.register_fake(f"{namespace}::linear_gguf")(
        lambda x, blocks, type: x.new_empty(x.shape[0], blocks.shape[0]))
    torch.library.register_fake(f"{namespace}::linear_k")(
        lambda x, blocks, type, path: x.new_empty(x.shape[0], blocks.shape[0]))
    torch.library.register_fake(f"{namespace}::linear_q8")(lambda x, codes, scales, n, path: x.new_empty(x.shape[0], n))
    torch.library.register_fake(f"{namespace}::attention")(
        lambda q, k, v, mask, scale: q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3]))

    def dequantized(blocks: torch.Tensor, kind: int) -> torch.Tensor:
        _, weights, nbytes = BLOCK_TYPES[TYPE_NAMES[kind]]
        return blocks.new_empty(blocks.shape[0], blocks.shape[1] // nbytes * weights, dtype=torch.float32)

    torch.library.register_fake(f"{namespace}::dequantize_gguf")(dequantized)
    return None


@functools.cache
def code_digest() -> str:
    """A digest of the code that runs a step here (this package, native_layers.py, the native sources and the variant):
    step latencies measured under other code are stale (calibrate.auto_tree keys its cached fits by it)."""
    digest = hashlib.sha256(variant().encode())
    package = Path(__file__).parent
    for source in [*sorted(package.glob("*.py")), package.with_name("native_layers.py"), *sorted(CSRC.glob("*"))]:
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def load_native(isa: str | None = None):
    """The ops of variant `isa` (None: the engine's), built once; a RuntimeError saying why where they cannot be."""
    if (error := native_build(isa)) is not None:
        raise RuntimeError(f"kernels='native': the native CPU kernel cannot be built here: {error}")
    return NAMESPACES[isa or variant()]


@torch.compiler.assume_constant_result
def engine_variant() -> str:
    """variant(), which torch.compile takes for a constant (it cannot trace the CPU's reading): its graphs call the
    variant's ops directly."""
    return variant()


def native_ops():
    """The engine's variant's ops (torch.ops.medusa_<variant>), which load_native builds and loads."""
    return NAMESPACES[engine_variant()]


@functools.cache
def native_available() -> bool:
    """Whether the native kernel runs here; where not, says why once (kernels='auto' then runs stock kernels)."""
    if (error := native_build()) is not None:
        print(f"medusa: native CPU kernels unavailable, running PyTorch's stock kernels: {error}", file=sys.stderr)
    return error is None
