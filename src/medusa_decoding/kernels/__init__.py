"""Which kernels run the model's few-token forward passes: the CPU fast path for MEDUSA steps.

A MEDUSA step on a CPU is a forward pass over 2-16 tokens, where stock `F.linear` (MKL) is at its worst: below 4
rows it streams the weights once, from 4 rows on it switches to a GEMM that costs much more. `native` runs every
float32 linear of up to MAX_ROWS rows through the project's own kernel (`csrc/linear.cpp`, built once per
machine): a few rows cost little more than one, and batch-invariant: a token's linears give it the same bits in a
tree pass as alone (attention still rounds differently, as with stock kernels; greedy output is the same). It
replaced oneDNN with packed weights, which it outran. int8 dynamic quantization (`torch.ao`) is faster still but not
offered: on SmolLM2-135M its greedy output leaves the float32 model's within the first few tokens. Neither is
bfloat16 (oneDNN AMX tiles: nearly flat from 1 to 16 tokens, but a 16-token pass rounds differently from a 1-token
pass, so the output would depend on the tree).

Weights dequantized from a GGUF file (the embedded default: linears Q4_1, the tied embedding Q8_0) are exactly
blocks of 32 small integer codes, a scale and an offset. `native` finds such weights (`block_codes`, checked bit for
bit) and reads the blocks instead, decoding them in the kernel to the very same float32 values: the output is
bitwise what float32 weights give, from a fifth (Q4_1) or a third (Q8_0) of the bytes, which lie side by side in
large pages (`in_large_pages`). Other weights run in float32 as before.

Any of them runs on either engine (`engine`: eager, or compiled.py's, every step of a fixed shape through
`torch.compile`, one graph per tree size, the kernels inside). The compiled engine's first use compiles each tree size
(inductor's on-disk cache shortens later runs), which a long-running process (`medusa serve`, `medusa bench`) wins
back.

`q8` reads the same blocks, repacked 16 rows at a time (`q8_pack`), with each token's activations quantized to 8 bits
per block and integer dot products (`Q8Linear`, llama.cpp's arithmetic; VNNI where the CPU has it): approximate
(benchmarks/q8_fidelity.py), batch-invariant still, and the fastest from one token to a tree.
q8 on the compiled engine is the fastest CPU setup, for those who accept q8's rounding.

`native` and `q8` run a step's attention through `invariant_attention` (`csrc/attention.cpp`):
each query over the keys it sees, in position order, so that a tree node gets bitwise what a one-token pass gives its
token; with batch-invariant linears a tree pass is then bitwise a run of one-token passes. With stock kernels, the
compiled engine runs it through `grouped_sdpa`: with a mask and more than one query, `transformers`' SDPA copies
every key and value once per query head that shares them (`repeat_kv`: the whole cache, every layer, every step);
SDPA's own grouped-query support reads them in place (a 1-token step, which `transformers` already packs, gains
nothing).

The heads' guesses need no such care: the float32 model verifies every one, so a guess may be approximate and the
output stays the same. Under native kernels, or any on the compiled engine, on a CPU in float32 they go through an
int8 copy of the LM head (`Int8Linear`, one scale per row): a quarter of the bytes of the largest matrix, read once
more every step for the guesses alone; the output and the acceptance stay the same. Heads calibrated with a guess
vocabulary (`set_guess_vocab`) keep only the rows of the tokens answers use most in that copy. Where the LM head
reads GGUF blocks (the embedded default's tied Q8_0 embedding) the copy is those blocks' rows instead (`BlockRows`):
exact, and fewer bytes than int8 with its scales.

One module a concern: build.py builds and loads the native library (csrc/) and picks its instruction-set variant;
linears.py holds the linears, blocks.py the GGUF blocks they read, attention.py the attention functions, guesses.py
the LM head's copy for the guesses; choice.py names the kernels and the engines and switches a model to them and back.
Measured side by side: benchmarks/cpu_kernels.py; the figures, with the machines they were measured on:
benchmarks/results/ (results_log.md).
"""

from .attention import GROUPED_ATTENTION, GROUPED_SDPA, INVARIANT_ATTENTION
from .blocks import LARGE_PAGE, Q8_KINDS, block_codes, gguf_codes, in_large_pages, q8_pack, q8_rounded
from .build import (
                    VARIANT_ENV,
                    VARIANTS,
                    code_digest,
                    cpu_variants,
                    load_native,
                    native_available,
                    native_build,
                    native_ops,
                    variant,
)
from .choice import (
                    ENGINES,
                    KERNELS,
                    compile_error,
                    cpu_float32,
                    native_linears,
                    reads_blocks,
                    reset_kernels,
                    resolve_engine,
                    resolve_kernels,
                    stock_kernels,
                    use_kernels,
)
from .guesses import BlockRows, Int8Linear, guess_projection, set_guess_vocab
from .linears import MAX_ROWS, Q8_PATHS, NativeLinear, Q8Linear, weight_rows

__all__ = ["ENGINES", "GROUPED_ATTENTION", "GROUPED_SDPA", "INVARIANT_ATTENTION", "KERNELS", "LARGE_PAGE", "MAX_ROWS",
           "Q8_KINDS", "Q8_PATHS", "VARIANTS", "VARIANT_ENV", "BlockRows", "Int8Linear", "NativeLinear",
           "Q8Linear", "block_codes", "code_digest", "compile_error", "cpu_float32", "cpu_variants", "gguf_codes",
           "guess_projection", "in_large_pages", "load_native", "native_available", "native_build", "native_linears",
           "native_ops", "q8_pack", "q8_rounded", "reads_blocks", "reset_kernels", "resolve_engine", "resolve_kernels",
           "set_guess_vocab", "stock_kernels", "use_kernels", "variant", "weight_rows"]
