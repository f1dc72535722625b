"""The flags several subcommands share, their defaults from config.py, and what they load: the model, a
GenerationConfig, the conversations of --data."""

import argparse
from dataclasses import fields

from ..config import ACCEPTANCE_RULES, CalibrateConfig, DistillConfig, GenerationConfig, ServerConfig, TrainConfig
from ..embedded import MODELS as EMBEDDED
from ..kernels import ENGINES, KERNELS

GENERATION = GenerationConfig()
SERVER = ServerConfig()
DISTILL = DistillConfig()
TRAIN = TrainConfig()
CALIBRATION = CalibrateConfig()
DTYPES = ("auto", "float32", "bfloat16")
MODEL_HELP = (f"base model: a GGUF file, an embedded model ({', '.join(EMBEDDED)}), a directory or hub id (default: "
              f"{next(iter(EMBEDDED))})")
RAW_HELP = "prompts as raw text, not through the chat template (the default where the model has none: a base model)"
DATA_HELP = "conversations: ShareGPT-style JSON/JSONL files, e.g. medusa distill's (several are read in order)"


def add_model_arguments(parser: argparse.ArgumentParser, heads: bool = True, kernels: bool = True) -> None:
    parser.add_argument("--model", help=MODEL_HELP)
    if heads:
        parser.add_argument("--heads", help="MEDUSA heads directory (default: shipped heads, else untrained)")
        parser.add_argument("--tree", default="auto", help="tree: JSON path list, Cartesian sizes, a JSON file, or "
                            "auto (default: fitted to this device from the heads' calibration, else their tree.json); "
                            "confident: auto's sizes, each step's likeliest candidates under the heads' own "
                            "probabilities; confident:N: N such candidates a step")
    if kernels:
        parser.add_argument("--kernels", choices=KERNELS, default="auto",
                            help="what runs the layers: auto (on a CPU in float32 the fastest of stock, native and "
                            "q8, timed once on this machine; else stock), stock, native (exact: batch-invariant "
                            "few-token linears and attention, built once per machine; $MEDUSA_ISA forces an "
                            "instruction set) or q8 (native with 8-bit activations on GGUF blocks: faster, "
                            "approximate)")
        parser.add_argument("--engine", choices=ENGINES, default="auto",
                            help="what runs the steps: auto (compiled on a GPU, else eager), eager or compiled "
                            "(fixed-shape steps through torch.compile, the kernels inside: compiling each tree size "
                            "on first use, then the fastest steps; on a CPU with --kernels q8 the fastest setup)")
        parser.add_argument("--dtype", choices=DTYPES, default="auto",
                            help="the model's dtype: auto (bfloat16 on a GPU, float32 on a CPU), float32 or "
                            "bfloat16. Greedy MEDUSA gives plain greedy decoding's tokens exactly where a tree's pass "
                            "rounds as a one-token pass does (float32 on the native CPU kernels); in bfloat16 a "
                            "near-tie between the top two tokens can flip")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=GENERATION.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=GENERATION.temperature)
    parser.add_argument("--top-p", type=float, default=GENERATION.top_p)
    parser.add_argument("--top-k", type=int, default=GENERATION.top_k)
    parser.add_argument("--acceptance", choices=ACCEPTANCE_RULES + ("auto",), default=GENERATION.acceptance)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=GENERATION.seed)
    add_draft_arguments(parser)


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lookup", type=int, default=GENERATION.lookup,
                        help="lookup drafts: at most this many tokens a step copied from where the text's last tokens "
                        "occurred before, verified beside the heads' candidates when they pay (0: none)")
    parser.add_argument("--corpus", type=int, default=GENERATION.corpus,
                        help="corpus drafts, where the heads have an index of the model's answers (medusa corpus): "
                        "at most this many tokens a step of what most often followed the text's last tokens there "
                        "(0: none)")


def load(args):
    """The model the flags name (--tree's text as it is: tree.parse_tree reads every form)."""
    import torch

    from ..model import MedusaModel

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    return MedusaModel.from_pretrained(args.model, args.heads, tree=args.tree, kernels=args.kernels, engine=args.engine,
                                       dtype=dtype)


def generation_config(args, **overrides) -> GenerationConfig:
    names = {f.name for f in fields(GenerationConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["stop"] = tuple(values.get("stop") or ())
    return GenerationConfig(**{**values, **overrides})


def read_data(paths: list[str]) -> list[list[dict]]:
    """The conversations of every --data file, in order."""
    from ..training.data import read_conversations

    return [chat for path in paths for chat in read_conversations(path)]
