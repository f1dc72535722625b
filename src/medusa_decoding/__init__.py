"""MEDUSA decoding for Hugging Face causal language models: extra heads guess several tokens ahead,
one tree-attention forward pass verifies them all."""

from .config import GenerationConfig, HeadsConfig
from .heads import MedusaHeads
from .model import GenerationOutput, MedusaModel
from .tree import Tree

__all__ = ["GenerationConfig", "GenerationOutput", "HeadsConfig", "MedusaHeads", "MedusaModel", "Tree"]
