"""ggml's tensor types as a GGUF file numbers them: what gguf_file reads and the kernels' shapes know of them."""

import torch

# the ggml numbers of the block types, their weights and bytes a block (GGML_QUANT_SIZES, as a file holds them)
BLOCK_TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
               "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210)}
FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16 by ggml's numbers
TYPE_NAMES = {0: "F32", 1: "F16", 30: "BF16", **{number: name for name, (number, _, _) in BLOCK_TYPES.items()}}
