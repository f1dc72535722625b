"""The base model: loaded from a GGUF file, a directory, the hub or an embedded model, with a MEDUSA-2 adapter
merged in, the tokens that end its answers and the context it attends over. `model` (decoding) and `training` both
start here."""

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import embedded, gguf_file


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every token that ends an answer: the model's generation config's and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    return frozenset(e for e in eos if e is not None)


def untie_output_embeddings(model: PreTrainedModel) -> None:
    """A tied lm_head gets its own copy: merging its LoRA must not move the input embeddings too."""
    output, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if output.weight.data_ptr() == embeddings.weight.data_ptr():
        output.weight = torch.nn.Parameter(embeddings.weight.detach().clone(), requires_grad=False)
        model.config.get_text_config().tie_word_embeddings = False
        model.config.tie_word_embeddings = False


def with_adapter(base: PreTrainedModel, adapter: Path) -> PreTrainedModel:
    """The base with a MEDUSA-2 LoRA adapter merged in (no adapter overhead when decoding)."""
    from peft import PeftModel

    untie_output_embeddings(base)  # as in training: the adapter's lm_head is not the embeddings
    return PeftModel.from_pretrained(base, adapter).merge_and_unload()


def resolve(model: str | os.PathLike | None) -> Path | str:
    """Where a model argument loads from: None or an embedded model's name, its conversion (embedded.py); a GGUF file,
    its conversion (gguf_file.py); a directory as it is; else a hub id. A ValueError or FileNotFoundError in one line
    for a path that is none of these."""
    if model is None or str(model) in embedded.MODELS:
        return embedded.converted_dir(embedded.MODELS.get(str(model), embedded.DEFAULT))
    path = Path(model).expanduser()
    if path.is_file():
        if not gguf_file.is_gguf(path):
            raise ValueError(f"model: {model} is neither a GGUF file nor a model directory")
        return gguf_file.model_dir(path, weights=True)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: {model} is neither a GGUF file nor a model directory (no config.json)")
        return path
    looks_local = path.is_absolute() or str(model).startswith((".", "~")) or str(model).count("/") > 1
    if looks_local or path.suffix == ".gguf":
        raise FileNotFoundError(f"model: {model} does not exist")
    return str(model)


def gguf_of(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file a model argument names (None: the embedded default's; an embedded model's name), or None: a
    directory or hub id."""
    if model is None or str(model) in embedded.MODELS:
        return embedded.gguf_path(embedded.MODELS.get(str(model), embedded.DEFAULT))
    path = Path(model).expanduser()
    return path if path.is_file() and gguf_file.is_gguf(path) else None


def load_base(model, dtype=None, device=None, blocks: bool = False, **load_kwargs
              ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A base model and tokenizer from a GGUF file, an embedded model's name, a directory or hub id; None: the
    embedded default.

    blocks: a GGUF file's model on its blocks, read from the file (gguf_file.load: the native kernels, on a CPU in
        float32), else with float32 weights (a GGUF file converted once: resolve).
    load_kwargs: passed on to `from_pretrained` (training's quantization_config, device_map).
    """
    if blocks and (gguf := gguf_of(model)) is not None:
        return gguf_file.load(gguf)
    path = resolve(model)
    try:
        base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, **load_kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise OSError(f"model: could not load {model!r}: {error}") from None
    return base.to(device) if device is not None else base, tokenizer


def sliding_window(model: PreTrainedModel) -> int | None:
    """The window of a model whose kinds of layer (`layer_types`: Gemma 3, Qwen2 ...) include sliding-window ones,
    which the engines emulate in their masks (cache.step_inputs), at any context; else None."""
    config = model.config.get_text_config()
    return config.sliding_window if "sliding_attention" in (getattr(config, "layer_types", None) or ()) else None


def context_limit(model: PreTrainedModel) -> int:
    """The longest sequence the model attends over correctly: a window not emulated (a Mistral's, every layer's, with
    no `layer_types`) caps it."""
    config = model.config.get_text_config()
    window = None if sliding_window(model) else getattr(config, "sliding_window", None)
    return min(int(n) for n in (getattr(config, "max_position_embeddings", None), window) if n)


def check_context(model: PreTrainedModel, prompt_len: int, max_new_tokens: int) -> None:
    if prompt_len < 1:
        raise ValueError("the prompt is empty: nothing to continue")
    limit = context_limit(model)
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the model's context of {limit} tokens"
        )
