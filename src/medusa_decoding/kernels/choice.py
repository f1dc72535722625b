"""Which kernels run a model, and switching it to them and back.

The names (KERNELS) and what each needs (resolve_kernels: a CPU in float32, the native build, torch.compile);
use_kernels switches a model in place to its linears (linears.py), the blocks they read (blocks.py), its attention
(attention.py) and a copy of the LM head for the guesses (guesses.py); reset_kernels undoes it, stock_kernels for the
length of a block.
"""

import contextlib
import shutil
import sys

import torch
from torch import nn

from .attention import GROUPED_ATTENTION, GROUPED_SDPA, INVARIANT_ATTENTION
from .blocks import GGML_Q4_K, GGML_Q6_K, block_codes, gguf_codes, in_large_pages, q8_pack, q8_rounded
from .build import load_native, native_available, native_build
from .guesses import GUESS_COPY, guess_copy
from .linears import NativeLinear, Q8Linear, weight_rows

KERNELS = ("auto", "stock", "native", "q8")
ENGINES = ("auto", "eager", "compiled")  # what runs the steps: eager.Eager or compiled.Compiled (engine.py)
NATIVE = ("native", "q8")  # the kernels that need the native build (and a CPU in float32)


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
    return (f"no C++ compiler: {compiler!r} is not on PATH "
            "(torch.compile builds C++ on the CPU; install g++, or set CXX)")


def cpu_float32(device: torch.device, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: native on a CPU in float32 where it builds (from_pretrained times stock, native and q8 there instead:
    model.fastest_kernels), else stock. q8 as native: a CPU in float32 and the native build."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    cpu_fp32 = cpu_float32(device, dtype)
    if kernels == "auto":
        return "native" if cpu_fp32 and native_available() else "stock"
    if kernels in NATIVE and not cpu_fp32:
        raise ValueError(f"kernels={kernels!r} runs on the CPU in float32 only, not {torch.device(device)} {dtype}")
    if kernels in NATIVE and (error := native_build()) is not None:
        raise ValueError(f"kernels={kernels!r} cannot run here: {error}")
    return kernels


def resolve_engine(engine: str, device: torch.device) -> bool:
    """Whether the compiled engine runs the steps. auto: on a GPU where torch.compile runs (else eagerly, saying why
    once), eagerly on a CPU (the compiled engine pays there only with q8's linears: asked for by name)."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "eager" or (engine == "auto" and torch.device(device).type != "cuda"):
        return False
    if (error := compile_error(device)) is None:
        return True
    if engine == "auto":
        print(f"medusa: compiled engine unavailable, decoding eagerly: {error}", file=sys.stderr)
        return False
    raise ValueError(f"engine='compiled' cannot run here: {error}")


def use_kernels(model: nn.Module, kernels: str, compiled: bool = False) -> nn.Module:
    """Switches `model` (in place) to `kernels`, for the engine that will run it (`compiled`: compiled.py): every
    nn.Linear to NativeLinear under "native" and "q8" (reading GGUF blocks where its weights are exactly those, with
    8-bit activations under "q8": Q8Linear). A float32 CPU model gets `invariant_attention` (native, else
    `grouped_sdpa`) in sdpa's place, a GPU one on the compiled engine `grouped_attention`; and its LM head a copy for
    the heads' guesses (`guess_copy`, `guess_projection`)."""
    if kernels == "stock" and not compiled:
        return model
    lm_head = model.get_output_embeddings()
    cpu_fp32 = cpu_float32(lm_head.weight.device, lm_head.weight.dtype)
    native = kernels in NATIVE
    if native:
        load_native()  # the ops the layers call; where "native" was asked for and cannot be built, a clear error
        on_blocks = []
        gguf = gguf_linears(model)
        for module in gguf:  # llama.cpp's arithmetic for the K-quants where q8's is asked for
            module.integer = kernels == "q8" and module.kind in (GGML_Q4_K, GGML_Q6_K)
        for module in native_linears(model) + gguf:
            on_file = "blocks" in module._buffers
            if (found := gguf_codes(module, kernels == "q8") if on_file else block_codes(module.weight)) is not None:
                if kernels == "q8" and (packed := q8_pack(*found)) is not None:  # in the layout Q8Linear reads
                    module.__class__, found = Q8Linear, packed
                module.register_buffer("codes", found[0], persistent=False)
                module.register_buffer("scales", found[1], persistent=False)
                on_blocks.append(module)
        in_large_pages(on_blocks)
    # models that take no registered attention function keep theirs
    if model.config._attn_implementation == "sdpa" and model._supports_attention_backend:
        if cpu_fp32:
            model.set_attn_implementation(INVARIANT_ATTENTION if native else GROUPED_SDPA)
        elif compiled and lm_head.weight.is_cuda:
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
    are (MedusaModel): a guess needs speed, not MKL's rounding. q8: to Q8Linear where the input is whole blocks, on
    the weights rounded to Q8_0 blocks (`q8_rounded`: a guess needs no more, from a quarter of the bytes); the
    parameters stay as they are."""
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


def reads_blocks(model: nn.Module) -> bool:
    """Whether use_kernels found GGUF blocks to read in place of some of the model's float32 weights."""
    return any(isinstance(m, NativeLinear) and hasattr(m, "codes") for m in model.modules())


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
