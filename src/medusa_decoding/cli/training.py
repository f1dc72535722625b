"""The subcommands that make heads and what they learn from: distill (the model's own answers), corpus (an index of
them beside the heads), train."""

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from ..config import (
    HEAD_KINDS,
    HEAD_TARGETS,
    LM_LOSSES,
    PROJECTIONS,
    QUANTIZATIONS,
    TRAIN_MODES,
    DistillConfig,
    TrainConfig,
)
from ..corpus import MIN_SEEN as CORPUS_MIN_SEEN
from .arguments import (
    CALIBRATION,
    DATA_HELP,
    DISTILL,
    MODEL_HELP,
    RAW_HELP,
    TRAIN,
    add_model_arguments,
    load,
    read_data,
)


def cmd_distill(args) -> None:
    from ..training.data import read_prompts
    from ..training.distill import distill

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"limit must be a positive integer, got {args.limit!r}")
    config = DistillConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           batch_size=args.batch_size, seed=args.seed, raw=args.raw)
    prompts = read_prompts(args.input)[: args.limit]
    stats = distill(load(args), prompts, args.output, config)
    skipped = f", {stats.skipped} skipped (past the context)" if stats.skipped else ""
    print(f"distill: {stats.records} new conversations{skipped}, {stats.tokens} answer tokens in {stats.seconds:.1f} s "
          f"({stats.tokens_per_s:.1f} tokens/s) -> {args.output}", file=sys.stderr)


def add_distill(sub) -> None:
    p = sub.add_parser("distill", help="self-distillation: the base model answers seed prompts (ShareGPT JSONL out)")
    p.add_argument("--input", required=True, help="prompts: seed {id, prompt}, ShareGPT or MT-Bench JSON/JSONL")
    p.add_argument("--output", required=True, help="JSONL to append to; ids already there are skipped (resume)")
    add_model_arguments(p, heads=False)
    p.add_argument("--max-new-tokens", type=int, default=DISTILL.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DISTILL.temperature)
    p.add_argument("--batch-size", type=int, default=DISTILL.batch_size, help="turns decoded together")
    p.add_argument("--limit", type=int, help="only the first N input records")
    p.add_argument("--seed", type=int, default=DISTILL.seed)
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    p.set_defaults(run=cmd_distill, heads=None, tree=None)


def cmd_corpus(args) -> None:
    from tqdm.auto import tqdm

    from ..base import load_base
    from ..corpus import CORPUS_NAME, CorpusIndex
    from ..training.data import IGNORE_INDEX, build_examples

    if not Path(args.heads).is_dir():
        raise FileNotFoundError(f"heads directory {args.heads} does not exist")
    conversations = read_data(args.data)  # before the model loads: bad data fails at once
    tokenizer = load_base(args.model)[1]
    examples = build_examples(tokenizer, tqdm(conversations, desc="tokenizing", unit="conv"), CALIBRATION.max_length)
    index = CorpusIndex.build(((e["input_ids"], [label != IGNORE_INDEX for label in e["labels"]]) for e in examples),
                              args.min_seen)
    index.save(args.heads)
    print(f"corpus: {len(index.keys)} contexts from the answers of {len(examples)} conversations -> "
          f"{Path(args.heads) / CORPUS_NAME}", file=sys.stderr)


def add_corpus(sub) -> None:
    p = sub.add_parser("corpus", help="index the model's own answers beside the heads: its corpus drafts (corpus.py)")
    p.add_argument("--data", required=True, nargs="+", help=DATA_HELP + "; the answers the model gave (never a "
                   "benchmark's)")
    p.add_argument("--heads", required=True, help="MEDUSA heads directory: the index goes beside them")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--min-seen", type=int, default=CORPUS_MIN_SEEN, help="keep contexts seen at least this often")
    p.set_defaults(run=cmd_corpus)


def cmd_train(args) -> None:
    import torch.distributed

    from ..training.start import load_backbone
    from ..training.train import train

    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)})
    conversations = read_data(args.data)  # before the model loads: bad data fails at once
    model, tokenizer = load_backbone(args.model, config)
    accuracy = train(model, tokenizer, conversations, args.output, config, init_heads=args.init_heads,
                     resume=args.resume, merge=args.merge)
    if torch.distributed.is_initialized():  # under torchrun: a process exiting with its group live may abort
        torch.distributed.destroy_process_group()
    for head in accuracy.get("heads", []):
        print(f"head {head['head']} ({head['predicts']}): top-1 {head['top1']:.3f}  top-5 {head['top5']:.3f}")
    print(f"train: heads -> {args.output}", file=sys.stderr)


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train MEDUSA heads (medusa1) or heads + LoRA backbone (medusa2)")
    p.add_argument("--data", required=True, nargs="+", help=DATA_HELP)
    p.add_argument("--output", required=True, help="directory for the heads, checkpoints/ and head_accuracy.json")
    add_model_arguments(p, heads=False, kernels=False)
    add_train_arguments(p)
    p.set_defaults(run=cmd_train)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags named after TrainConfig's fields (dest), defaults from it."""
    add = parser.add_argument
    add("--mode", choices=TRAIN_MODES, default=TRAIN.mode, help="medusa1: frozen backbone; medusa2: LoRA backbone too")
    add("--kind", choices=HEAD_KINDS, default=TRAIN.kind,
        help="medusa: heads on the last hidden state; hydra: they also read the tokens before their guess")
    add("--num-heads", type=int, default=TRAIN.num_heads)
    add("--num-layers", type=int, default=TRAIN.num_layers)
    add("--projection", choices=PROJECTIONS, default=TRAIN.projection)
    add("--feature-layers", nargs="+", type=int, default=TRAIN.feature_layers, metavar="LAYER",
        help="the heads also read these layers' outputs (RMS-normalised) beside the last hidden state, e.g. 8 16 24 "
             "(EAGLE-3's fused features; --init-heads without them start at zero weights)")
    add("--epochs", type=float, default=TRAIN.epochs)
    add("--max-steps", type=int, default=TRAIN.max_steps, help="stop after this many steps (overrides --epochs)")
    add("--lr", dest="learning_rate", metavar="LR", type=float, default=TRAIN.learning_rate,
        help=f"the heads' learning rate; medusa2's LoRA gets lr / {TRAIN.heads_lr_ratio:g}")
    add("--batch-size", type=int, default=TRAIN.batch_size)
    add("--grad-accum", dest="gradient_accumulation_steps", metavar="N", type=int,
        default=TRAIN.gradient_accumulation_steps)
    add("--max-length", type=int, default=TRAIN.max_length, help="tokens per conversation (longer ones are cut)")
    add("--warmup-steps", type=int, default=TRAIN.warmup_steps)
    add("--decay", type=float, default=TRAIN.decay, help="head k's loss weight is decay**k")
    add("--lambda0", type=float, default=TRAIN.lambda0, help="medusa2: loss = L_LM + lambda0 * L_heads")
    add("--targets", choices=HEAD_TARGETS, default=TRAIN.targets,
        help="medusa1: what head k learns at t: the data's token t+k+2 (tokens) or the frozen model's distribution "
             "over it (teacher: softmax of its logits at t+k+1; Hydra++'s target)")
    add("--lm-loss", choices=LM_LOSSES, default=TRAIN.lm_loss,
        help="medusa2 backbone term: kl to the original model (self-distilled data) or ce to the data")
    add("--lora-r", type=int, default=TRAIN.lora_r)
    add("--lora-alpha", type=int, default=TRAIN.lora_alpha)
    add("--lora-dropout", type=float, default=TRAIN.lora_dropout)
    add("--guess-vocab", type=int, default=TRAIN.guess_vocab,
        help="medusa1, shared projection: rank the N tokens the answers use most in the heads' loss (0: all; "
             "fewer make a CPU step faster)")
    add("--position-batch", type=int, default=TRAIN.position_batch, metavar="N",
        help="medusa1: compute the frozen backbone's states at the answer positions once, then train on shuffled "
             "batches of N positions (e.g. 256: many more updates per hour than batches of conversations)")
    add("--quantize", choices=QUANTIZATIONS, default=TRAIN.quantize, help="medusa1: frozen backbone in 8/4 bit (GPU)")
    add("--bf16", action="store_true", help="backbone in bfloat16, mixed-precision training")
    add("--eval-fraction", type=float, default=TRAIN.eval_fraction, help="held out for per-head accuracy")
    add("--save-steps", type=int, default=TRAIN.save_steps, help="checkpoint and evaluate every this many steps")
    add("--seed", type=int, default=TRAIN.seed)
    add("--init-heads", help="start from these trained heads instead of fresh ones (MEDUSA heads may start hydra "
        "heads, and heads may start deeper ones: --num-layers more; the new weights start at zero, the logits "
        "unchanged)")
    add("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT/checkpoints (with "
        "--position-batch, states already computed in OUTPUT/states are read back whether or not)")
    add("--merge", action="store_true", help="medusa2: also write the merged model to OUTPUT/model")
