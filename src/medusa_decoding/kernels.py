"""Which kernels run the model's few-token forward passes: the CPU fast path for MEDUSA steps.

A MEDUSA step on a CPU is a forward pass over 2-16 tokens, where stock `F.linear` (MKL) is at its worst: below 4
rows it streams the weights once, from 4 rows on it switches to a GEMM that costs much more. `native` runs every
float32 linear of up to MAX_ROWS rows through the project's own kernel (`csrc/linear.cpp`, built once per
machine): a few rows cost little more than one, and batch-invariant: a token's linears give it the same bits in a
tree pass as alone (attention still rounds differently, ~1e-5 of a logit, as with stock kernels; greedy output is
the same). It replaced oneDNN with packed weights, which it outran. int8 dynamic quantization (`torch.ao`) is
faster still but not offered: on SmolLM2-135M its greedy output leaves the float32 model's within the first few
tokens. Neither is bfloat16 (oneDNN AMX tiles: nearly flat from 1 to 16 tokens, but a 16-token pass
rounds differently from a 1-token pass, so the output would depend on the tree).

Weights dequantized from a GGUF file (the embedded default: linears Q4_1, the tied embedding Q8_0) are exactly
blocks of 32 small integer codes, a scale and an offset. `native` finds such weights (`block_codes`, checked bit for
bit) and reads the blocks instead, decoding them in the kernel to the very same float32 values: the output is
bitwise what float32 weights give, from a fifth (Q4_1) or a third (Q8_0) of the bytes, which lie side by side in
large pages (`in_large_pages`). Other weights run in float32 as before.

`compiled` is the compiled engine (compiled.py): every step of a fixed shape through `torch.compile`, one graph
per tree size, with native linears and attention inside on a CPU in float32 where they build. Its first use compiles
each tree size (inductor's on-disk cache shortens later runs), which a long-running process (`medusa serve`,
`medusa bench`) wins back.

`q8` reads the same blocks, repacked 16 rows at a time (`q8_pack`), with each token's activations quantized to 8 bits
per block and integer dot products (`Q8Linear`, llama.cpp's arithmetic; VNNI where the CPU has it): approximate
(benchmarks/q8_fidelity.py), batch-invariant still, and the fastest from one token to a tree.
`compiled-q8` runs them on the compiled engine: the fastest CPU setup, for those who accept q8's rounding.

`native`, `q8` and the compiled kernels run a step's attention through `invariant_attention` (`csrc/attention.cpp`): each
query over the keys it sees, in position order, so that a tree node gets bitwise what a one-token pass gives its
token; with batch-invariant linears a tree pass is then bitwise a run of one-token passes. Without the native build,
`compiled` runs it through `grouped_sdpa`: with a mask and more than one query, `transformers`' SDPA copies every key
and value once per query head that shares them (`repeat_kv`: 3x for SmolLM2, the whole cache, every layer, every
step); SDPA's own grouped-query support reads them in place (a 1-token step, which `transformers` already packs,
gains nothing).

The heads' guesses need no such care: the float32 model verifies every one, so a guess may be approximate and the
output stays the same. Under native or compiled kernels on a CPU in float32 they go through an int8 copy of the LM
head (`Int8Linear`, one scale per row): a quarter of the bytes of the largest matrix, read once more every step
for the guesses alone; the output and the acceptance stay the same. Heads calibrated with a guess vocabulary
(`set_guess_vocab`) keep only the rows of the tokens answers use most in that copy. Where the LM head reads GGUF
blocks (the embedded default's tied Q8_0 embedding) the copy is those blocks' rows instead (`BlockRows`): exact, and
fewer bytes than int8 with its scales.
Measured side by side: benchmarks/cpu_kernels.py; the figures, with the machines they were measured on:
benchmarks/results/README.md.
"""

import contextlib
import functools
import hashlib
import itertools
import mmap
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
from torch import nn
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .ggml_types import BLOCK_TYPES, TYPE_NAMES

KERNELS = ("auto", "stock", "native", "q8", "compiled", "compiled-q8")
COMPILED = ("compiled", "compiled-q8")  # the kernels that decode on the compiled engine
NATIVE = ("native", "q8", "compiled-q8")  # the kernels that need the native build (and a CPU in float32)
Q8 = ("q8", "compiled-q8")  # the kernels whose linears on GGUF blocks take 8-bit activations
MAX_ROWS = 128  # native linears up to here: every tree of up to 127 candidates; above (a prefill) stock, q8 still
DECODED_ROWS = 4096  # a GGUF linear's prefill decodes its weights this many rows at a time (an LM head: 64 of 8B's MB)
BLOCK = 32  # weights per GGUF block
LARGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and on aarch64 with 4 KB base pages
CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("linear.cpp", "kquants.cpp", "attention.cpp", "layer.cpp", "library.cpp")]
HEADERS = [CSRC / name for name in ("simd.h", "ops.h")]
GUESS_COPY = "guesses"  # the LM head's submodule that the heads' guesses go through on a CPU in float32
Q8_PATHS = ("scalar", "avx2", "avx_vnni", "avx512_vnni")  # medusa::linear_q8's instruction paths, by number
# ggml's numbers of the block types NativeLinear's `codes` hold, of those q8 kernels read as Q8_0's codes
# (gguf_codes), and of those medusa::linear_k reads with 8-bit activations
GGML_Q4_1, GGML_Q8_0, GGML_Q4_0, GGML_Q5_0, GGML_Q4_K, GGML_Q6_K = (
    BLOCK_TYPES[name][0] for name in ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"))
Q8_KINDS = (GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K)  # q8 kernels' GGUF types
# the native kernels' instruction-set variants (csrc/simd.h: the same bits from each), fastest first, and their flags
# (F16C, which widens a float16 cache, came with AVX2 on every CPU that has it)
VARIANTS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
            "avx2": ["-mavx2", "-mfma", "-mf16c"], "baseline": []}
VARIANT_ENV = "MEDUSA_ISA"  # forces a variant for the whole engine (one this CPU runs)
OPS = None  # the engine's variant's ops (torch.ops.medusa_<variant>), once load_native has loaded them


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


@functools.cache
def build_variant(isa: str) -> str | None:
    """native_build's work, once a process per variant: a namespace's ops register once (a second copy aborts)."""
    from torch.utils.cpp_extension import get_cxx_compiler, load

    from .config import cache_root

    if missing := [path.name for path in SOURCES + HEADERS if not path.is_file()]:
        return f"the native kernels' sources are missing from {CSRC}: {', '.join(missing)} (a broken install?)"
    if shutil.which(get_cxx_compiler()) is None:
        return f"no C++ compiler: {get_cxx_compiler()!r} is not on PATH (install g++, or set CXX)"
    if shutil.which("ninja") is None:  # torch runs `ninja` from PATH: the pip package's, outside an activated venv
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    name = f"medusa_kernels_{isa}"
    build = cache_root() / "kernels" / f"{name}_{sys.implementation.cache_tag}_torch{torch.__version__}"
    if not (build / f"{name}.so").exists():
        print(f"medusa: building the native CPU kernels ({isa}) for this machine (once, about 30 s)", file=sys.stderr)
    build.mkdir(parents=True, exist_ok=True)
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]  # rebuilt when they change
    try:  # -Wno-psabi: vectors passed between the functions of one path, all inlined into it
        load(name, [str(source) for source in SOURCES], extra_cflags=[
             "-O3", "-fopenmp", "-Wno-psabi", "-ffp-contract=off", "-fvisibility=hidden", f"-DMEDUSA_OPS=medusa_{isa}",
             f"-DMEDUSA_HEADERS={headers}", *VARIANTS[isa]], extra_ldflags=["-fopenmp"], build_directory=str(build),
             is_python_module=False)
    except Exception as error:  # the compiler's own output: its first error line says why
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f"the native kernels did not build: {next((l for l in lines if 'error' in l.lower()), lines[0] if lines else error)}"
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
    """A digest of the code that runs a step here (this module, native_layers.py, the native sources and the variant):
    step latencies measured under other code are stale (calibrate.auto_tree keys its cached fits by it)."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + variant().encode())
    for source in [Path(__file__).with_name("native_layers.py"), *sorted(CSRC.glob("*"))]:  # whatever of it exists
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def load_native(isa: str | None = None):
    """The ops of variant `isa` (None: the engine's), built once; a RuntimeError saying why where they cannot be."""
    global OPS
    if (error := native_build(isa)) is not None:
        raise RuntimeError(f"kernels='native': the native CPU kernel cannot be built here: {error}")
    ops = getattr(torch.ops, f"medusa_{isa or variant()}")
    if isa is None or isa == variant():
        OPS = ops
    return ops


@functools.cache
def native_available() -> bool:
    """Whether the native kernel runs here; where not, says why once (kernels='auto' then runs stock kernels)."""
    if (error := native_build()) is not None:
        print(f"medusa: native CPU kernels unavailable, running PyTorch's stock kernels: {error}", file=sys.stderr)
    return error is None


def blocks_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for W held as GGUF blocks (block_codes' codes and scales; 4- or 8-bit, told by their width)."""
    return OPS.linear_blocks(x, codes, scales, 8 * codes.shape[1] // x.shape[-1])


def recorded(*tensors: torch.Tensor) -> bool:
    """Whether autograd records a pass over `tensors` (training a switched model): the medusa ops have no backward,
    so such a pass takes stock kernels whatever its rows (else its gradients would be silently missing)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class NativeLinear(nn.Linear):
    """An nn.Linear that runs medusa::linear on inputs of up to MAX_ROWS rows (a MEDUSA step) and stock kernels
    above (a prefill) and wherever autograd records (`recorded`); where `use_kernels` found its weights to be exact
    GGUF blocks (`block_codes`), it reads those (`codes`, `scales`) instead: the same bits from a fifth or a third of
    the bytes. The blocks are found once, when the layer is switched: a weight changed in place later
    (load_state_dict, merging an adapter) must be switched on a fresh model. Parameters, tied embeddings, the state
    dict and save_pretrained are unchanged.

    A model read at its GGUF file's bytes (gguf_file.load) has NativeLinears whose weights are the file's blocks as it
    holds them (`blocks` uint8 [N, bytes a row], `kind`: ggml's type number) and whose `weight` is a placeholder of
    the right shape (NaN, one element): few-row passes read the blocks (medusa::linear_gguf: bitwise medusa::linear
    over the weights they decode to), or `codes` and `scales` where use_kernels derived them (Q4_1, Q8_0), or under
    q8 kernels, Q4_K and Q6_K blocks with llama.cpp's 8-bit activations (medusa::linear_k, csrc/kquants.cpp); see
    float_linear for the rest."""

    kind: int = 0  # a GGUF linear's block type
    integer: bool = False  # a GGUF linear's Q4_K or Q6_K blocks read with 8-bit activations (q8 kernels: linear_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > MAX_ROWS * x.shape[-1] or recorded(x, self.weight):
            return float_linear(self, x)
        x2 = x.reshape(-1, x.shape[-1])
        # a SmolLM2 step makes 211 of these calls: each attribute read through nn.Module.__getattr__ costs a microsecond
        if (codes := self._buffers.get("codes")) is not None:
            out = blocks_linear(x2, codes, self._buffers["scales"])
        elif (blocks := self._buffers.get("blocks")) is not None:
            out = OPS.linear_k(x2, blocks, self.kind, -1) if self.integer else OPS.linear_gguf(x2, blocks, self.kind)
        else:
            out = OPS.linear(x2, self.weight)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


def float_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A switched linear's pass over float32 weights (MKL): a prefill's many rows, and any pass autograd records.
    A GGUF linear decodes its weights DECODED_ROWS rows at a time for it (the float32 model's GEMM, never the whole
    matrix at once); autograd has no way through its blocks: a recorded pass is an error."""
    if (blocks := linear._buffers.get("blocks")) is None:
        return nn.functional.linear(x, linear.weight, linear.bias)
    if recorded(x):
        raise RuntimeError("a GGUF model's linears read its blocks, which have no gradient: train MEDUSA-2 on the "
                           "model's float32 conversion (gguf_file.model_dir(path, weights=True))")
    out = torch.cat([nn.functional.linear(x, OPS.dequantize_gguf(blocks[n:n + DECODED_ROWS], linear.kind))
                     for n in range(0, blocks.shape[0], DECODED_ROWS)], -1)
    return out if linear.bias is None else out + linear.bias


class Q8Linear(NativeLinear):
    """A NativeLinear on GGUF blocks whose few-row passes quantize each token's activations to 8 bits per block of 32
    and sum the products in integers (medusa::linear_q8, llama.cpp's arithmetic) over weights repacked for it
    (`q8_pack`: its `codes` and `scales` are in that layout): still batch-invariant, approximate (`benchmarks/q8_fidelity.py`
    measures how far from the float32 model), and faster than float32 from one token to a tree's 16. It runs the
    fastest instructions this CPU has; the op's `path` argument forces others (Q8_PATHS' index: tests run each).
    A prefill's many rows go through it too (a block of codes serves every row from L1: faster than MKL's float32
    GEMM, and llama.cpp's arithmetic for the prompt as well), except where autograd records (no backward here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if recorded(x, self.weight):
            return float_linear(self, x)
        out = OPS.linear_q8(x.reshape(-1, x.shape[-1]), self._buffers["codes"], self._buffers["scales"],
                                         self.out_features, -1)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


def q8_pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """block_codes' (codes, scales) in medusa::linear_q8's layout: rows in groups of 16 (the last padded with zero
    blocks), per block the group's codes 4 by 4, row after row (4 bytes of row 0, 4 of row 1, ...), so that one
    integer dot-product instruction sums 4 products in each of 16 rows; the scales in float16, as GGUF stores them, as
    [group, block, (d, m), row]. Q4_1's bytes already hold weights j and j + 16 as nibbles: byte groups 0-3 give
    weights 0-15 (low) and 16-31 (high). Returns (codes uint8 [G, K / 32, 16 * bytes a block], scales float16
    [G, K / 32, 2, 16]), or None where a scale is not a float16 (a weight GGUF blocks did not give).

    >>> [t.shape for t in q8_pack(torch.zeros(20, 64, dtype=torch.uint8), torch.zeros(20, 2, 2))]
    [torch.Size([2, 2, 512]), torch.Size([2, 2, 2, 16])]
    """
    if not torch.equal(scales.half().float(), scales):
        return None
    rows, blocks = scales.shape[:2]
    groups, padding = -(-rows // 16), -rows % 16
    codes = nn.functional.pad(codes.reshape(rows, blocks, -1), (0, 0, 0, 0, 0, padding))
    codes = codes.reshape(groups, 16, blocks, -1, 4).permute(0, 2, 3, 1, 4).reshape(groups, blocks, -1)
    scales = nn.functional.pad(scales, (0, 0, 0, 0, 0, padding)).reshape(groups, 16, blocks, 2).permute(0, 2, 3, 1)
    return codes.contiguous(), scales.half().contiguous()


def block_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Finds whether a float32 weight [N, K] is exactly GGUF Q4_1 or Q8_0 blocks, as a model dequantized from
    such a file is: per block of 32 weights, w = code * d + m bitwise, d and m float16, codes 4-bit (Q4_1: m the
    block's minimum) or 8-bit (Q8_0: q + 128 with m = -128 d, so that both decode alike). Returns (codes uint8
    [N, K * bits / 8], 4-bit ones two a byte as GGUF packs them; scales float32 [N, K / 32, 2]: d, m) or None.

    >>> block_codes(torch.randn(64, 576)) is None  # weights never quantized
    True
    """
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    blocks = weight.detach().reshape(weight.shape[0], -1, BLOCK)
    for bits in (4, 8):
        if fit_blocks(blocks[:1], bits) is not None:  # one row rules out most weights that are neither
            if (fit := fit_blocks(blocks, bits)) is not None:
                codes, scales = fit
                if bits == 4:  # byte i of a block: code i (low nibble), code i + 16 (high)
                    codes = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)
                return codes.reshape(weight.shape[0], -1), scales
    return None


def fit_blocks(blocks: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """blocks [N, B, 32] -> (codes uint8 [N, B, 32], scales [N, B, 2]) that decode to them bitwise, or None."""
    if bits == 4:
        low = blocks.amin(-1)
        guess = ((blocks.amax(-1) - low) / 15).half()
    else:
        low, guess = None, (blocks.abs().amax(-1) / 127).half()
    codes, scales, exact = codes_at(blocks, guess, low, bits)  # a model's load: every block at once, in place
    for ulps in (1, -1):  # d was rounded to float16 from the original block; the guess lies within an ulp
        if exact.all():
            return codes, scales
        todo = ~exact
        d = (guess[todo].view(torch.int16) + ulps).view(torch.float16)
        found, found_scales, right = codes_at(blocks[todo], d, None if low is None else low[todo], bits)
        where = todo.nonzero()[right].unbind(1)
        codes[where], scales[where], exact[where] = found[right], found_scales[right], True
    return (codes, scales) if exact.all() else None


def codes_at(blocks: torch.Tensor, d: torch.Tensor, low: torch.Tensor | None, bits: int):
    """The codes of blocks [..., 32] at float16 scales d [...] (offset `low`, None: 8-bit's -128 d), their scales
    [..., 2] and whether each block decodes to them bitwise (code * d + m: GGUF's rounding, no fused multiply-add)."""
    d = d.float()
    m = low if low is not None else -128 * d
    q = (blocks - m[..., None]).div_(d[..., None]).nan_to_num_().round_().clamp_(0, 2**bits - 1)
    exact = ((q * d[..., None]).add_(m[..., None]).view(torch.int32) == blocks.view(torch.int32)).all(-1)
    return q.to(torch.uint8), torch.stack([d, m], -1), exact


class Int8Linear(nn.Module):
    """An approximate copy of a linear layer for inference: int8 weights with one scale per output row (weight-only,
    bfloat16 activations through `torch._weight_int8pack_mm`). Its buffers are not saved with the model.
    rows: keep only these output rows (e.g. token ids), in this order; output i is then row rows[i].

    >>> Int8Linear(nn.Linear(576, 49152, bias=False))(torch.randn(4, 576)).shape
    torch.Size([4, 49152])
    """

    def __init__(self, linear: nn.Linear, rows: torch.Tensor | None = None):
        super().__init__()
        weight = linear.weight.detach().float()
        bias = None if linear.bias is None else linear.bias.detach().float()
        if rows is not None:
            weight, bias = weight[rows], None if bias is None else bias[rows]
        scales = weight.abs().amax(1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("weight", torch.round(weight / scales[:, None]).to(torch.int8), persistent=False)
        self.register_buffer("scales", scales.bfloat16(), persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).bfloat16(), self.weight, self.scales).to(x.dtype)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


class BlockRows(nn.Module):
    """Rows of a NativeLinear that reads GGUF blocks (`codes`, `scales`), read as it reads them (a Q8Linear's with
    8-bit activations): its own outputs on those rows, from the fewest bytes. rows: as Int8Linear's (None: all, the
    blocks shared, not copied)."""

    def __init__(self, linear: NativeLinear, rows: torch.Tensor | None = None):
        super().__init__()
        codes, scales, bias = linear._buffers["codes"], linear._buffers["scales"], linear.bias
        self.q8 = type(linear) is Q8Linear
        if rows is not None:  # a Q8Linear's rows come packed 16 together: those rows' blocks are packed anew
            codes, scales = (q8_pack(*block_codes(weight_rows(linear, rows))) if self.q8 else
                             (codes[rows].contiguous(), scales[rows].contiguous()))
            bias = None if bias is None else bias[rows]
        self.out_features = linear.out_features if rows is None else len(rows)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach(), persistent=False)
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = (OPS.linear_q8(x2, self.codes, self.scales, self.out_features, -1) if self.q8 else
               blocks_linear(x2, self.codes, self.scales))
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


def guess_copy(lm_head: nn.Module, rows: torch.Tensor | None = None) -> nn.Module:
    """The LM head's copy that the heads' guesses go through on a CPU in float32, on `rows` (None: all): its GGUF
    blocks where it reads them (the embedded default's Q8_0 embedding: its own arithmetic on those rows, and fewer
    bytes than Int8Linear's rows and scales), else int8 weights (Int8Linear: a quarter of float32's bytes,
    approximate; a guess needs no more)."""
    if isinstance(lm_head, NativeLinear) and "codes" in lm_head._buffers:
        return BlockRows(lm_head, rows)
    if isinstance(lm_head, NativeLinear) and "blocks" in lm_head._buffers:
        return GgufRows(lm_head, rows)
    return Int8Linear(lm_head, rows)


class GgufRows(nn.Module):
    """Rows of a GGUF linear, read as it reads them (its blocks' rows: exact, and no more bytes than the file's)."""

    def __init__(self, linear: NativeLinear, rows: torch.Tensor | None = None):
        super().__init__()
        blocks = linear._buffers["blocks"]
        self.kind, self.out_features = linear.kind, linear.out_features if rows is None else len(rows)
        self.register_buffer("blocks", blocks if rows is None else blocks[rows], persistent=False)
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = OPS.linear_gguf(x.reshape(-1, x.shape[-1]), self.blocks, self.kind)
        return out.reshape(*x.shape[:-1], -1)


GROUPED_SDPA = "grouped_sdpa"
PLAIN_ATTENTION_KWARGS = {"dropout", "scaling", "position_ids", "use_cache", "sliding_window", "cache_position",
                          "output_hidden_states"}  # the last: passed down by models, unread by attention


def grouped_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """`transformers`' SDPA attention, except that a masked pass over several queries with grouped keys and values
    leaves the grouping to SDPA (enable_gqa) instead of copying them per query head. query: [B, H, T, D];
    key, value: [B, H_kv, S, D] -> [B, T, H, D]."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1 and attention_mask is not None and query.shape[2] > 1
    if not grouped or dropout or not kwargs.keys() <= PLAIN_ATTENTION_KWARGS:  # anything else: transformers' own
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                     enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # the prefill's causal mask, built as for sdpa

GROUPED_ATTENTION = "grouped_attention"


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The compiled engine's attention on a GPU: a step's few queries under a float mask as two matmuls, each group
    of query heads side by side against its one key/value head, softmax in float32; the cache is read once, not
    copied per query head (`transformers`' SDPA path repeats every layer's keys and values when a mask is given).
    The prefill and anything else: grouped_sdpa. query: [B, H, T, D]; key, value: [B, H_kv, S, D] -> [B, T, H, D]."""
    mask, (batch, heads, queries, dim), kv_heads = attention_mask, query.shape, key.shape[1]
    step = mask is not None and mask.dtype == query.dtype and mask.dim() == 4 and queries <= MAX_ROWS
    if not step or dropout or not kwargs.keys() <= PLAIN_ATTENTION_KWARGS:
        return grouped_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else dim ** -0.5
    grouped = query.reshape(batch, kv_heads, heads // kv_heads * queries, dim)  # a group's heads are adjacent
    scores = (grouped @ key.transpose(-1, -2)).float().unflatten(2, (heads // kv_heads, queries)) * scale
    weights = (scores + mask[:, :, None].float()).softmax(-1).to(value.dtype).flatten(2, 3)
    return (weights @ value).view(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
AttentionMaskInterface.register(GROUPED_ATTENTION, sdpa_mask)

INVARIANT_ATTENTION = "medusa_attention"


def invariant_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The attention of native kernels: a MEDUSA step's queries (a float mask, 0 where a key is seen, or one query
    seeing every key) through medusa::attention, whose output for a query depends only on the keys it sees, in
    position order; a tree node then gets bitwise what a one-token pass gives its token, and a row of a batch what
    it gets alone. The prefill (a causal pass over the prompt), a pass autograd records and anything else through
    grouped_sdpa. query: [B, H, T, D]; key, value: [B, H_kv, S, D] -> [B, T, H, D]."""
    mask, (batch, _, queries, _) = attention_mask, query.shape
    step = (mask is None and queries == 1) or (mask is not None and mask.dtype == query.dtype and mask.dim() == 4
                                               and mask.shape[1] == 1 and queries <= MAX_ROWS)
    if not step or dropout or recorded(query, key, value) or not kwargs.keys() <= PLAIN_ATTENTION_KWARGS:
        return grouped_sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = None if mask is None else mask[:, 0].expand(batch, -1, -1)
    return OPS.attention(query, key, value, mask, scale), None


AttentionInterface.register(INVARIANT_ATTENTION, invariant_attention)
AttentionMaskInterface.register(INVARIANT_ATTENTION, sdpa_mask)


def compile_error(device: torch.device) -> str | None:
    """Why torch.compile cannot run on `device` here, or None: on a CPU inductor builds C++ with its compiler, on a
    GPU it writes Triton kernels."""
    from torch._inductor import config
    from torch.utils._triton import has_triton

    if torch.device(device).type != "cpu":
        return None if has_triton() else "no Triton (torch.compile writes GPU kernels in Triton; pip install triton)"
    compiler = config.cpp.cxx[-1]  # $CXX, else g++
    if shutil.which(compiler) is not None:
        return None
    return f"no C++ compiler: {compiler!r} is not on PATH (torch.compile builds C++ on the CPU; install g++, or set CXX)"


def cpu_float32(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: compiled on a GPU where torch.compile runs (else stock, saying why once), native on a CPU in float32
    where it builds (MedusaModel times stock, native and q8 there instead: calibrate.choose_kernels), else stock.
    q8 as native. compiled runs anywhere torch.compile does; compiled-q8 where both q8 and torch.compile do."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    cpu_fp32 = cpu_float32(device, dtype)
    if kernels == "auto" and torch.device(device).type == "cuda":
        if (error := compile_error(device)) is not None:
            print(f"medusa: compiled engine unavailable, decoding eagerly: {error}", file=sys.stderr)
        return "stock" if error else "compiled"
    if kernels == "auto":
        return "native" if cpu_fp32 and native_available() else "stock"
    native = kernels in NATIVE
    if native and not cpu_fp32:
        raise ValueError(f"kernels={kernels!r} runs on the CPU in float32 only, not {torch.device(device)} {dtype}")
    error = native_build() if native else None
    error = error or (compile_error(device) if kernels in COMPILED else None)
    if error is not None:
        raise ValueError(f"kernels={kernels!r} cannot run here: {error}")
    return kernels


def use_kernels(model: nn.Module, kernels: str) -> nn.Module:
    """Switches `model` (in place) to `kernels`: every nn.Linear to NativeLinear ("native", "q8", "compiled-q8", and
    "compiled" on a CPU in float32 where native builds; reading GGUF blocks where its weights are exactly those, with
    8-bit activations under "q8" and "compiled-q8": Q8Linear); the compiled kernels then decode on the compiled
    engine (compiled.py, which decoding.Batch runs where MedusaModel's kernels say so). A float32 CPU model gets
    `invariant_attention` (where native builds, else `grouped_sdpa`) in sdpa's place, and its LM head a copy for the
    heads' guesses (`guess_copy`, `guess_projection`)."""
    if kernels == "stock":
        return model
    lm_head = model.get_output_embeddings()
    cpu_fp32 = cpu_float32(lm_head.weight.device, lm_head.weight.dtype)
    native = kernels in NATIVE or (kernels == "compiled" and cpu_fp32 and native_available())
    if native:
        load_native()  # the ops the layers call; where "native" was asked for and cannot be built, a clear error
        on_blocks = []
        gguf = gguf_linears(model)
        for module in gguf:  # llama.cpp's arithmetic for the K-quants where q8's is asked for
            module.integer = kernels in Q8 and module.kind in (GGML_Q4_K, GGML_Q6_K)
        for module in native_linears(model) + gguf:
            on_file = "blocks" in module._buffers
            if (found := gguf_codes(module, kernels in Q8) if on_file else block_codes(module.weight)) is not None:
                if kernels in Q8 and (packed := q8_pack(*found)) is not None:  # in the layout Q8Linear reads
                    module.__class__, found = Q8Linear, packed
                module.register_buffer("codes", found[0], persistent=False)
                module.register_buffer("scales", found[1], persistent=False)
                on_blocks.append(module)
        in_large_pages(on_blocks)
    # models that take no registered attention function keep theirs
    if model.config._attn_implementation == "sdpa" and model._supports_attention_backend:
        if cpu_fp32:
            model.set_attn_implementation(INVARIANT_ATTENTION if native else GROUPED_SDPA)
        elif kernels in COMPILED and lm_head.weight.is_cuda:
            model.set_attn_implementation(GROUPED_ATTENTION)
    if cpu_fp32 and not hasattr(lm_head, GUESS_COPY):
        lm_head.add_module(GUESS_COPY, guess_copy(lm_head))
    return model


def reset_kernels(module: nn.Module) -> nn.Module:
    """Undoes use_kernels (and native_linears) in place: stock linears and attention, no guess copy; `module` can
    then be switched to other kernels (kernels="auto" times each in turn on the one model, without a copy)."""
    for linear in module.modules():
        if isinstance(linear, NativeLinear):
            linear.__class__ = NativeLinear if "blocks" in linear._buffers else nn.Linear  # a GGUF one stays on them
            linear.integer = False
            for name in ("codes", "scales"):
                linear._buffers.pop(name, None)
    config = getattr(module, "config", None)
    if getattr(config, "_attn_implementation", None) in (GROUPED_SDPA, INVARIANT_ATTENTION, GROUPED_ATTENTION):
        module.set_attn_implementation("sdpa")
    if hasattr(module, "get_output_embeddings") and hasattr(lm_head := module.get_output_embeddings(), GUESS_COPY):
        delattr(lm_head, GUESS_COPY)
    return module


def native_linears(module: nn.Module, q8: bool = False) -> list[NativeLinear]:
    """Switches every nn.Linear of `module` (in place) to NativeLinear; returns them. The heads' too where the model's
    are (MedusaModel): a guess needs speed, not MKL's rounding (over one token medusa::linear runs a head's layer
    several times faster than MKL). q8: to Q8Linear where the input is whole blocks, on the weights rounded to Q8_0
    blocks (`q8_rounded`: a guess needs no more, from a quarter of the bytes); the parameters stay as they are."""
    switched = [m for m in module.modules() if type(m) is nn.Linear]
    for linear in switched:
        packed = q8_rounded(linear.weight) if q8 else None
        linear.__class__ = NativeLinear if packed is None else Q8Linear
        if packed is not None:
            linear.register_buffer("codes", packed[0], persistent=False)
            linear.register_buffer("scales", packed[1], persistent=False)
    in_large_pages([linear for linear in switched if "codes" in linear._buffers])
    return switched


def gguf_linears(module: nn.Module) -> list[NativeLinear]:
    """The linears of `module` that read a GGUF file's blocks (gguf_file.load)."""
    return [m for m in module.modules() if isinstance(m, NativeLinear) and "blocks" in m._buffers]


def gguf_codes(linear: NativeLinear, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GGUF linear's Q4_1 or Q8_0 blocks as block_codes gives them (codes, scales: d and m), read from the blocks
    themselves rather than found in float weights; `signed`, Q4_0's and Q5_0's too, as Q8_0's (their signed codes q
    as q + 128, m = -128 d: llama.cpp's integer sums of q times the activations, on q8 kernels); None for other
    types."""
    blocks, kind = linear._buffers["blocks"], linear.kind
    if kind not in (GGML_Q4_1, GGML_Q8_0) + ((GGML_Q4_0, GGML_Q5_0) if signed else ()):
        return None
    rows = blocks.shape[0]
    blocks = blocks.reshape(rows, -1, BLOCK_TYPES[TYPE_NAMES[kind]][2])
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()
    if kind == GGML_Q4_1:
        m, codes = blocks[..., 2:4].contiguous().view(torch.float16).float(), blocks[..., 4:]
    elif kind == GGML_Q8_0:  # Q8_0's signed codes q as q + 128, m = -128 d: they decode alike (block_codes)
        m, codes = -128 * d, (blocks[..., 2:].contiguous().view(torch.int8).short() + 128).to(torch.uint8)
    else:  # weight j's low 4 bits in byte j % 16 (low nibble below 16), Q5_0's fifth in bit j of qh; q = code - 8 or 16
        low = blocks[..., -16:].short()
        code = torch.cat([low & 15, low >> 4], -1)
        if kind == GGML_Q5_0:
            qh = blocks[..., 2:6].contiguous().view(torch.int32)
            code |= ((qh >> torch.arange(32, dtype=torch.int32)) & 1).short() << 4
        m, codes = -128 * d, (code + (128 - (16 if kind == GGML_Q5_0 else 8))).to(torch.uint8)
    return codes.reshape(rows, -1).contiguous(), torch.cat([d, m], -1)


def weight_rows(linear: nn.Linear, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A linear's float32 weight rows (None: all): its weight's, or those its GGUF blocks decode to."""
    if (blocks := linear._buffers.get("blocks")) is None:
        return linear.weight.detach() if rows is None else linear.weight.detach()[rows]
    return OPS.dequantize_gguf(blocks if rows is None else blocks[rows], linear.kind)


def in_large_pages(modules: list[nn.Module]) -> None:
    """Moves the blocks (`codes`, `scales`) of `modules` in place, side by side, into one buffer that Linux may back
    with 2 MB pages (transparent huge pages, asked for with madvise; elsewhere they stay where they were). A step
    streams every block from memory: in 4 KB pages each page costs a TLB miss and the hardware prefetcher stops at
    its end (benchmarks/large_pages.py measures what that costs). The bits stay the same: a copy."""
    tensors = [module._buffers[name] for module in modules for name in ("codes", "scales")]
    if not tensors or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    starts = list(itertools.accumulate((-(-tensor.nbytes // 64) * 64 for tensor in tensors), initial=0))  # lines
    pages = mmap.mmap(-1, starts[-1] + LARGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages.madvise(mmap.MADV_HUGEPAGE)  # before the first write: the pages come large from the start
    buffer = torch.frombuffer(pages, dtype=torch.uint8)  # keeps `pages` mapped while any view lives
    buffer = buffer[-buffer.data_ptr() % LARGE_PAGE:]  # from a 2 MB boundary
    views = iter(buffer[start:start + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
                 for tensor, start in zip(tensors, starts))
    for module in modules:
        module._buffers["codes"], module._buffers["scales"] = next(views), next(views)


def q8_rounded(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A float weight [N, K] rounded to GGUF's Q8_0 blocks (per block of 32, q = round(w / d), d = amax / 127 in
    float16), in q8_pack's layout; None where K is not whole blocks.

    >>> [t.shape for t in q8_rounded(torch.randn(20, 64))]
    [torch.Size([2, 2, 512]), torch.Size([2, 2, 2, 16])]
    """
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    blocks = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    d = (blocks.abs().amax(-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, blocks / d[..., None], 0).round().clamp(-127, 127)
    return q8_pack((q + 128).to(torch.uint8).flatten(1), torch.stack([d, -128 * d], -1))


def reads_blocks(model: nn.Module) -> bool:
    """Whether use_kernels found GGUF blocks to read in place of some of the model's float32 weights."""
    return any(isinstance(m, NativeLinear) and hasattr(m, "codes") for m in model.modules())


def guess_projection(model: nn.Module) -> nn.Module:
    """What the heads' guesses are projected through: the LM head's copy (guess_copy) where use_kernels made one, else
    the LM head itself. The model's own logits always come from the LM head."""
    lm_head = model.get_output_embeddings()
    return getattr(lm_head, GUESS_COPY, lm_head)


def set_guess_vocab(model: nn.Module, vocab: torch.Tensor | None) -> None:
    """Lets the heads guess only tokens of `vocab` (ids; None: all), where use_kernels gave the LM head a copy
    for the guesses: the copy keeps those rows. The guesses of a step then cost a fraction of a projection onto the
    whole vocabulary, and are as often right (`medusa calibrate` picks the tokens). Elsewhere (stock kernels, a GPU)
    nothing changes: the guesses cost little there. The model still verifies every guess against its whole
    vocabulary."""
    lm_head = model.get_output_embeddings()
    if not hasattr(lm_head, GUESS_COPY):
        return
    if vocab is not None and not (vocab.dim() == 1 and len(vocab) and 0 <= int(vocab.min())
                                  and int(vocab.max()) < lm_head.out_features and len(vocab.unique()) == len(vocab)):
        raise ValueError(f"guess vocabulary: distinct token ids below {lm_head.out_features} expected (heads "
                         "calibrated for another model?)")
    lm_head.add_module(GUESS_COPY, guess_copy(lm_head, vocab))


@contextlib.contextmanager
def stock_kernels(model: nn.Module):
    """Runs native linears on stock kernels inside the block: the baseline of what `transformers` alone gives (a GGUF
    model's linears get the float32 weights their blocks decode to for it, as transformers' own GGUF loading does:
    the float model's memory)."""
    native = [(m, type(m), m.weight) for m in model.modules() if isinstance(m, NativeLinear)]
    attention = model.config._attn_implementation
    ours = attention in (GROUPED_SDPA, INVARIANT_ATTENTION)
    for module, _, _ in native:
        if "blocks" in module._buffers:  # a GGUF linear: the float32 weights transformers would have loaded
            module.weight = nn.Parameter(weight_rows(module), requires_grad=False)
        module.__class__ = nn.Linear
    if ours:
        model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        for module, kind, weight in native:
            module.__class__, module.weight = kind, weight
        if ours:
            model.set_attn_implementation(attention)
