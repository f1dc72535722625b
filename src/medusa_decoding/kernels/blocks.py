"""GGUF blocks in the forms the kernels read: found bit for bit in float32 weights (block_codes), read from a file's
own blocks (gguf_codes), rounded to Q8_0 (q8_rounded), repacked for medusa::linear_q8 (q8_pack), and laid side by
side in large pages (in_large_pages).
"""

import itertools
import mmap

import torch
from torch import nn

from ..ggml_types import BLOCK_TYPES, TYPE_NAMES

BLOCK = 32  # weights per GGUF block
LARGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and on aarch64 with 4 KB base pages
# ggml's numbers of the block types NativeLinear's `codes` hold, of those q8 kernels read as Q8_0's codes
# (gguf_codes), and of those medusa::linear_k reads with 8-bit activations
GGML_Q4_1, GGML_Q8_0, GGML_Q4_0, GGML_Q5_0, GGML_Q4_K, GGML_Q6_K = (
    BLOCK_TYPES[name][0] for name in ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"))
Q8_KINDS = (GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q8_0, GGML_Q4_K, GGML_Q6_K)  # q8 kernels' GGUF types


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


def gguf_codes(linear: nn.Linear, signed: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
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
