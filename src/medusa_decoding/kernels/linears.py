"""The linears of few-token passes: NativeLinear runs medusa::linear (or reads GGUF blocks in the kernel) up to
MAX_ROWS rows, Q8Linear the same blocks with 8-bit activations; a prefill's many rows and any pass autograd records
go through stock kernels (float_linear).
"""

import torch
from torch import nn

from .build import native_ops

MAX_ROWS = 128  # native linears up to here: every tree of up to 127 candidates; above (a prefill) stock, q8 still
DECODED_ROWS = 4096  # a GGUF linear's prefill decodes its weights this many rows at a time (an LM head: 64 of 8B's MB)
Q8_PATHS = ("scalar", "avx2", "avx_vnni", "avx512_vnni")  # medusa::linear_q8's instruction paths, by number


def blocks_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W.T for W held as GGUF blocks (block_codes' codes and scales; 4- or 8-bit, told by their width)."""
    return native_ops().linear_blocks(x, codes, scales, 8 * codes.shape[1] // x.shape[-1])


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
        # a step makes hundreds of these calls: buffers read from _buffers, not through nn.Module.__getattr__
        if (codes := self._buffers.get("codes")) is not None:
            out = blocks_linear(x2, codes, self._buffers["scales"])
        elif (blocks := self._buffers.get("blocks")) is not None:
            ops = native_ops()
            out = ops.linear_k(x2, blocks, self.kind, -1) if self.integer else ops.linear_gguf(x2, blocks, self.kind)
        else:
            out = native_ops().linear(x2, self.weight)
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
    out = torch.cat([nn.functional.linear(x, native_ops().dequantize_gguf(blocks[n:n + DECODED_ROWS], linear.kind))
                     for n in range(0, blocks.shape[0], DECODED_ROWS)], -1)
    return out if linear.bias is None else out + linear.bias


class Q8Linear(NativeLinear):
    """A NativeLinear on GGUF blocks whose few-row passes quantize each token's activations to 8 bits per block of 32
    and sum the products in integers (medusa::linear_q8, llama.cpp's arithmetic) over weights repacked for it
    (`q8_pack`: its `codes` and `scales` are in that layout): still batch-invariant, approximate
    (`benchmarks/q8_fidelity.py` measures how far from the float32 model), and faster than float32 from one token to a
    tree's 16. It runs the fastest instructions this CPU has; the op's `path` argument forces others (Q8_PATHS'
    index: tests run each). A prefill's many rows go through it too (a block of codes serves every row from L1:
    faster than MKL's float32 GEMM, and llama.cpp's arithmetic for the prompt as well), except where autograd records
    (no backward here)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if recorded(x, self.weight):
            return float_linear(self, x)
        out = native_ops().linear_q8(x.reshape(-1, x.shape[-1]), self._buffers["codes"], self._buffers["scales"],
                                     self.out_features, -1)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


def weight_rows(linear: nn.Linear, rows: torch.Tensor | None = None) -> torch.Tensor:
    """A linear's float32 weight rows (None: all): its weight's, or those its GGUF blocks decode to."""
    if (blocks := linear._buffers.get("blocks")) is None:
        return linear.weight.detach() if rows is None else linear.weight.detach()[rows]
    return native_ops().dequantize_gguf(blocks if rows is None else blocks[rows], linear.kind)
