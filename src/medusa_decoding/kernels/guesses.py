"""The copy of the LM head that the heads' guesses go through on a CPU in float32 (guess_copy).

The float32 model verifies every guess, so a guess may be approximate and the output stays the same: the copy reads
fewer bytes than the LM head (its GGUF blocks where it reads them, else int8 rows), once more every step for the
guesses alone, and may keep only the rows of the tokens answers use most (set_guess_vocab).
"""

import torch
from torch import nn

from .blocks import block_codes, q8_pack
from .build import native_ops
from .linears import NativeLinear, Q8Linear, blocks_linear, weight_rows

GUESS_COPY = "guesses"  # the LM head's submodule that the heads' guesses go through on a CPU in float32


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
        out = (native_ops().linear_q8(x2, self.codes, self.scales, self.out_features, -1) if self.q8 else
               blocks_linear(x2, self.codes, self.scales))
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


class GgufRows(nn.Module):
    """Rows of a GGUF linear, read as it reads them (its blocks' rows: exact, and no more bytes than the file's)."""

    def __init__(self, linear: NativeLinear, rows: torch.Tensor | None = None):
        super().__init__()
        blocks = linear._buffers["blocks"]
        self.kind, self.out_features = linear.kind, linear.out_features if rows is None else len(rows)
        self.register_buffer("blocks", blocks if rows is None else blocks[rows], persistent=False)
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = native_ops().linear_gguf(x.reshape(-1, x.shape[-1]), self.blocks, self.kind)
        return out.reshape(*x.shape[:-1], -1)
