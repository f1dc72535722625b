"""The decoders a benchmark compares, each on one prompt: MEDUSA, plain decoding, `transformers` generate, llama.cpp,
rivals (other heads, trees or engines) and MEDUSA without one source of drafts."""

import time
from dataclasses import replace

import torch
import transformers

from .. import llamacpp
from ..config import GenerationConfig
from ..kernels import stock_kernels
from ..model import GenerationOutput, MedusaModel

DECODERS = ("medusa", "plain", "transformers")
LLAMA_CPP = "llama.cpp"  # a decoder where `benchmark` is given a llama.cpp model
OTHER_ENGINES = ("transformers", LLAMA_CPP)  # their tokens are not held to plain decoding's (lossless)
NO_LOOKUP = "medusa, no lookup"  # MEDUSA without its lookup drafts, where the config has them: what they add
NO_CORPUS = "medusa, no corpus"  # MEDUSA without its corpus drafts, where its heads have an index: what they add
WITHOUT = {NO_LOOKUP: "lookup", NO_CORPUS: "corpus"}  # such variants: the GenerationConfig field they set to 0
OWN_PLAIN = "/plain"  # NAME/plain: plain decoding on a rival's engine where it is not MEDUSA's, the rival's reference


def hf_generate(medusa: MedusaModel, ids: torch.Tensor, config: GenerationConfig) -> GenerationOutput:
    """`transformers` generate with the same settings on stock kernels; one forward pass per token (the prefill's
    first)."""
    sampling = config.temperature > 0
    settings = transformers.GenerationConfig(
        max_new_tokens=config.max_new_tokens, do_sample=sampling, temperature=config.temperature if sampling else None,
        top_p=config.top_p if sampling else None, top_k=config.top_k if sampling else None,
        eos_token_id=sorted(medusa.eos_ids), pad_token_id=min(medusa.eos_ids, default=0),
    )
    if sampling and config.seed is not None:
        torch.manual_seed(config.seed)
    with torch.inference_mode(), stock_kernels(medusa.model):  # what `transformers` alone gives
        start = time.perf_counter()  # after a GGUF model's float32 weights are made
        sequence = medusa.model.generate(ids[None], attention_mask=torch.ones_like(ids)[None],
                                         generation_config=settings)
    new = sequence[0, len(ids):].tolist()  # inside the clock: waits for the device, as MEDUSA's per-step lists do
    seconds = time.perf_counter() - start
    return GenerationOutput(token_ids=new, accept_lengths=[1] * len(new), text=medusa.decode(new), seconds=seconds)


def without(medusa: MedusaModel, config: GenerationConfig) -> tuple[str, ...]:
    """The variants of MEDUSA with one source of drafts off, for the sources this run decodes with."""
    return tuple(name for name, field in WITHOUT.items()
                 if getattr(config, field) and (field != "corpus" or medusa.corpus is not None))


def run_decoder(name: str, medusa: MedusaModel, ids: torch.Tensor, config: GenerationConfig,
                llama=None, rivals: dict[str, MedusaModel] | None = None) -> GenerationOutput:
    if rivals and name in rivals:
        return rivals[name].generate(ids, config=config)
    if rivals and name.removesuffix(OWN_PLAIN) in rivals:  # engines round differently: each is held to its own plain
        return rivals[name.removesuffix(OWN_PLAIN)].generate(ids, config=config, medusa=False)
    if name in WITHOUT:
        return medusa.generate(ids, config=replace(config, **{WITHOUT[name]: 0}))
    if name == "transformers":
        return hf_generate(medusa, ids, config)
    if name == LLAMA_CPP:
        out = llamacpp.generate(llama, ids.tolist(), config.max_new_tokens, medusa.eos_ids)
        out.text = medusa.decode(out.token_ids)
        return out
    return medusa.generate(ids, config=config, medusa=name == "medusa")


def answer_turn(medusa: MedusaModel, ids: torch.Tensor, config: GenerationConfig, turn: int, llama=None,
                repeat: int = 1, rivals: dict[str, MedusaModel] | None = None) -> dict[str, GenerationOutput]:
    """Every decoder on one prompt, `repeat` rounds, their order rotated by `turn` and the round so none always runs
    first; each decoder's fastest run counts (another process on a shared machine only ever slows a run down, and by
    as much from one minute to the next as the decoders differ)."""
    names = DECODERS + tuple(rivals or ()) + tuple(f"{name}{OWN_PLAIN}" for name, view in (rivals or {}).items()
                                                   if view.compiled != medusa.compiled)
    names += (LLAMA_CPP,) if llama is not None else ()
    names += without(medusa, config)
    fastest: dict[str, GenerationOutput] = {}
    for round_ in range(repeat):
        shift = (turn + round_) % len(names)
        for name in names[shift:] + names[:shift]:
            out = run_decoder(name, medusa, ids, config, llama, rivals)
            if name not in fastest or out.seconds < fastest[name].seconds:
                fastest[name] = out
    return fastest
