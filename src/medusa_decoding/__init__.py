"""MEDUSA decoding for Hugging Face causal language models: extra heads guess several tokens ahead,
one tree-attention forward pass verifies them all."""

import os

from .config import cache_root

# what torch.compile builds stays in the project's cache (not /tmp, which a reboot clears), so a second run compiles
# nothing: set before any module touches inductor, which fixes its directory on first use
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))

from .config import GenerationConfig, HeadsConfig
from .heads import MedusaHeads
from .model import GenerationOutput, MedusaModel
from .tree import Tree

__all__ = ["GenerationConfig", "GenerationOutput", "HeadsConfig", "MedusaHeads", "MedusaModel", "Tree"]
