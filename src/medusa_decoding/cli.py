"""`medusa` command line: one small function per subcommand, all built from config.py's defaults."""

import argparse
import json
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from .config import ACCEPTANCE_RULES, DEFAULT_MODEL, EXPORT_FORMATS, GenerationConfig, ServerConfig
from .config import (HEAD_KINDS, HEAD_TARGETS, LM_LOSSES, PROJECTIONS, QUANTIZATIONS, TRAIN_MODES, CalibrateConfig,
                     DistillConfig, TrainConfig)
from .corpus import MIN_SEEN as CORPUS_MIN_SEEN
from .kernels import KERNELS
from .embedded import MODELS as EMBEDDED

ENGINES = ("compiled", "eager")  # what a bench rival may decode on (--rival NAME=...+ENGINE)
DEFAULTS = GenerationConfig()
SERVER = ServerConfig()
API_KEY_ENV = "MEDUSA_API_KEY"  # `medusa serve --api-key`'s default, kept out of the process list
DISTILL = DistillConfig()
TRAIN = TrainConfig()
CALIBRATE = CalibrateConfig()
DTYPES = ("auto", "float32", "bfloat16")
MODEL_HELP = (f"base model: a GGUF file, an embedded model ({', '.join(EMBEDDED)}), a directory or hub id (default: "
              f"{next(iter(EMBEDDED))})")
RAW_HELP = "prompts as raw text, not through the chat template (the default where the model has none: a base model)"
DATA_HELP = "conversations: ShareGPT-style JSON/JSONL files, e.g. medusa distill's (several are read in order)"


def add_model_arguments(parser: argparse.ArgumentParser, heads: bool = True, kernels: bool = True) -> None:
    parser.add_argument("--model", help=MODEL_HELP)
    if heads:
        parser.add_argument("--heads", help="MEDUSA heads directory (default: shipped heads, else untrained)")
        parser.add_argument("--tree", default="auto", help="tree: JSON path list, Cartesian sizes, a JSON file, or auto "
                            "(default: fitted to this device from the heads' calibration, else their tree.json); "
                            "confident: auto's sizes, each step's likeliest candidates under the heads' own "
                            "probabilities; confident:N: N such candidates a step")
    if kernels:
        parser.add_argument("--kernels", choices=KERNELS, default="auto",
                            help="kernels: auto (compiled on a GPU; on a CPU in float32 the fastest of stock, native "
                            "and q8, timed once on this machine), stock, native (exact: batch-invariant few-token "
                            "linears and attention, built once per machine; $MEDUSA_ISA forces an instruction set), "
                            "q8 (native with 8-bit activations on GGUF blocks: faster, approximate), "
                            "compiled (fixed-shape steps through torch.compile, native kernels inside on a CPU: "
                            "about 40 s of compiling per tree size on first use, then the fastest steps), "
                            "compiled-q8 (compiled, with q8's linears: the fastest on a CPU, approximate)")
        parser.add_argument("--dtype", choices=DTYPES, default="auto",
                            help="the model's dtype: auto (bfloat16 on a GPU, float32 on a CPU), float32 or "
                            "bfloat16. Greedy MEDUSA gives plain greedy decoding's tokens exactly where a tree's pass "
                            "rounds as a one-token pass does (float32 on the native CPU kernels); in bfloat16 a "
                            "near-tie between the top two tokens can flip")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    parser.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k)
    parser.add_argument("--acceptance", choices=ACCEPTANCE_RULES + ("auto",), default=DEFAULTS.acceptance)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_draft_arguments(parser)


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lookup", type=int, default=DEFAULTS.lookup,
                        help="lookup drafts: at most this many tokens a step copied from where the text's last tokens "
                        "occurred before, verified beside the heads' candidates when they pay (0: none)")
    parser.add_argument("--corpus", type=int, default=DEFAULTS.corpus,
                        help="corpus drafts, where the heads have an index of the model's answers (medusa corpus): "
                        "at most this many tokens a step of what most often followed the text's last tokens there "
                        "(0: none)")


def load(args):
    """The model the flags name (--tree's text as it is: tree.parse_tree reads every form)."""
    import torch

    from .model import MedusaModel

    return MedusaModel.from_pretrained(args.model, args.heads, tree=args.tree, kernels=args.kernels,
                                       dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))


def generation_config(args, **overrides) -> GenerationConfig:
    names = {f.name for f in fields(GenerationConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values["stop"] = tuple(values.get("stop") or ())
    return GenerationConfig(**{**values, **overrides})


def cmd_generate(args) -> None:
    config = generation_config(args)
    medusa = load(args)
    if args.json:
        out = medusa.generate(args.prompt, config=config, raw=args.raw)
        record = {
            "text": out.text,
            "token_ids": out.token_ids,
            "steps": out.steps,
            "accept_lengths": out.accept_lengths,
            "tree_sizes": out.tree_sizes,
            "tokens_per_s": out.tokens_per_s,
        }
        print(json.dumps(record))
        return
    for piece in medusa.stream(args.prompt, config=config, raw=args.raw):
        print(piece, end="", flush=True)
    print()


UNTRAINED = (
    "heads: UNTRAINED. Fresh heads only repeat the base model's next-token guess, so almost no guess is\n"
    "accepted: this run shows that the machinery works and is lossless, not a speedup (expect MEDUSA to be\n"
    "somewhat slower than plain decoding). Train heads with `medusa distill` + `medusa train`, then --heads DIR."
)


def heads_trained(heads) -> bool:
    """Fresh heads keep every residual block at its zero init; training moves them."""
    from .heads import ResBlock

    return any(bool(block.linear.weight.any()) for block in heads.modules() if isinstance(block, ResBlock))


def combined(outputs: list):
    """Several GenerationOutputs as one: their tokens, forward passes and seconds added up."""
    from .model import GenerationOutput

    return GenerationOutput(
        token_ids=[t for out in outputs for t in out.token_ids],
        accept_lengths=[n for out in outputs for n in out.accept_lengths],
        seconds=sum(out.seconds for out in outputs),
    )


def demo_row(label: str, fast, plain, hf, identical: bool) -> str:
    """One line of the demo's table: MEDUSA (`fast`) against plain decoding and transformers generate (`hf`)."""
    speedup = fast.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0
    vs_hf = fast.tokens_per_s / hf.tokens_per_s if hf.tokens_per_s else 0.0
    return (f"{label[:36]:<36} {len(fast.token_ids):>6} {fast.tokens_per_s:>12.1f} {fast.acceleration_rate:>11.2f} "
            f"{plain.tokens_per_s:>11.1f} {hf.tokens_per_s:>8.1f} {speedup:>7.2f}x {vs_hf:>6.2f}x  {'yes' if identical else 'NO'}")


def cmd_demo(args) -> None:
    from transformers import TextStreamer

    from .bench import hf_generate
    from .calibrate import setup

    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    medusa = load(args)
    trained = heads_trained(medusa.heads)
    trees = medusa.trees.trees
    choice = (f"trees of {trees[0].num_nodes - 1} to {trees[-1].num_nodes - 1} candidates, picked each step by what pays "
              "(plain first)" if len(trees) > 1 else f"a tree of {medusa.tree.num_nodes - 1} "
              "candidates")
    print(f"MEDUSA demo: {args.model or DEFAULT_MODEL.name}, {medusa.heads.config.num_heads} "
          f"{'trained' if trained else 'untrained'} heads, {choice} (--tree {args.tree}), greedy, up to "
          f"{config.max_new_tokens} new tokens per answer, on {setup(medusa)}")
    print("heads: trained" if trained else UNTRAINED)
    start = time.perf_counter()
    medusa.warm_up(DEFAULT_MODEL.demo_prompts[0], config)  # off the clock
    if medusa.compiled:
        print(f"warm-up: {time.perf_counter() - start:.0f} s, compiling each tree size on first use")
    rows = []
    for prompt in DEFAULT_MODEL.demo_prompts:
        print(f"\n>>> {prompt}")
        streamer = TextStreamer(medusa.tokenizer, skip_prompt=True, skip_special_tokens=True)
        fast = medusa.generate(prompt, config=config, streamer=streamer)  # timed while it streams
        plain = medusa.generate(prompt, config=config, medusa=False)
        hf = hf_generate(medusa, medusa.encode(prompt), config)
        rows.append((prompt, fast, plain, hf, fast.token_ids == plain.token_ids))
        print(f"    MEDUSA {fast.tokens_per_s:.1f} tok/s ({fast.acceleration_rate:.2f} tokens/step)  |  "
              f"plain {plain.tokens_per_s:.1f} tok/s  |  transformers generate {hf.tokens_per_s:.1f} tok/s  |  "
              f"identical: {'yes' if rows[-1][-1] else 'NO'}")
    print(f"\n{'prompt':<36} {'tokens':>6} {'MEDUSA tok/s':>12} {'tokens/step':>11} {'plain tok/s':>11} "
          f"{'HF tok/s':>8} {'speedup':>8} {'vs HF':>7}  identical")
    for row in rows:
        print(demo_row(*row))
    totals = [combined([row[i] for row in rows]) for i in (1, 2, 3)]
    print(demo_row("all prompts", *totals, all(row[-1] for row in rows)))
    print("tok/s: new tokens / wall time incl. prefill; tokens/step: new tokens / forward passes; speedup: vs plain\n"
          "decoding in the same engine; vs HF: vs transformers generate on stock kernels (what transformers alone gives)")


def cmd_export(args) -> None:
    """Nothing runs: the heads from their files (any layout), the base model only for its LM head and vocabulary. The
    embedded default's MEDUSA heads unless --heads names others (its default hydra heads have no such layout)."""
    from . import embedded
    from .base import load_base
    from .formats import export
    from .heads import MedusaHeads

    if args.heads is None and args.model is not None:
        raise ValueError("export: give --heads (only the embedded default ships trained heads)")
    heads_dir = args.heads or embedded.MEDUSA_HEADS
    start = time.perf_counter()
    base, _ = load_base(args.model)
    lm_head = base.get_output_embeddings()
    heads = MedusaHeads.from_pretrained(heads_dir, vocab_size=lm_head.weight.shape[0])
    config = base.config.get_text_config()
    heads.check_compatible(config.hidden_size, lm_head.weight.shape[0], base.name_or_path, config.num_hidden_layers)
    out = export(heads, args.out, args.format, lm_head)
    size = sum(path.stat().st_size for path in out.iterdir() if path.is_file())
    print(f"wrote {heads.config.num_heads} heads ({heads_dir}) in the {args.format} layout to {out}: "
          f"{size / 2**20:.1f} MiB in {time.perf_counter() - start:.1f} s")


def cmd_chat(args) -> None:
    from .chat import chat

    try:
        chat(load(args), generation_config(args), raw=args.raw)
    except KeyboardInterrupt:  # Ctrl-C while the model loads: leave as quietly as chat() does
        print()


def cmd_serve(args) -> None:
    import uvicorn

    from .server import Scheduler, create_app

    config = ServerConfig(args.host, args.port, args.max_batch, args.max_queue, args.max_tree_nodes, args.max_tree_depth,
                          args.api_key or os.environ.get(API_KEY_ENV) or None)
    scheduler = Scheduler(config.max_batch, config.max_queue)
    medusa = scheduler.load(lambda: load(args))  # on the thread that will run it (Scheduler says why)
    uvicorn.run(create_app(medusa, args.model or DEFAULT_MODEL.name, scheduler, config), host=config.host,
                port=config.port)


def cmd_distill(args) -> None:
    from .training.data import read_prompts
    from .training.distill import distill

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"limit must be a positive integer, got {args.limit!r}")
    config = DistillConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           batch_size=args.batch_size, seed=args.seed, raw=args.raw)
    prompts = read_prompts(args.input)[: args.limit]
    stats = distill(load(args), prompts, args.output, config)
    skipped = f", {stats.skipped} skipped (past the context)" if stats.skipped else ""
    print(f"distill: {stats.records} new conversations{skipped}, {stats.tokens} answer tokens in {stats.seconds:.1f} s "
          f"({stats.tokens_per_s:.1f} tokens/s) -> {args.output}", file=sys.stderr)


def cmd_bench(args) -> None:
    import torch

    from . import llamacpp
    from .base import context_limit, gguf_of
    from .bench import benchmark, plot, read_questions, table
    from .calibrate import read_accuracy

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"threads must be a positive integer, got {args.threads!r}")
        torch.set_num_threads(args.threads)  # a shared CPU: fewer threads than cores, or OpenMP spin-waits
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    # before the model loads: bad input fails at once
    questions = read_questions(args.questions, categories, args.limit, args.per_category)
    config = generation_config(args)
    if args.concurrency:
        return bench_serving(args, [q.turns[0] for q in questions], config)
    sweep = tuple(sorted({int(n) for n in args.sweep.split(",")})) if args.sweep else ()
    if any(n < 1 for n in sweep):
        raise ValueError(f"sweep: tree sizes must be positive integers, got {args.sweep!r}")
    specs = rival_specs(args.rival)
    if args.llama_cpp is not None:
        llamacpp.require()
        if not args.llama_cpp and gguf_of(args.model) is None:
            raise ValueError("--llama-cpp: give the GGUF file of --model (it is not one)")
    medusa = load(args)
    gguf = args.llama_cpp or gguf_of(args.model)
    llama = None if args.llama_cpp is None else llamacpp.load(gguf, torch.get_num_threads(), context_limit(medusa.model))
    if not heads_trained(medusa.heads):
        print(UNTRAINED, file=sys.stderr)
    calibration = read_accuracy(medusa.heads_dir) if medusa.heads_dir else None  # predictions need it
    rivals = {name: medusa.with_heads(heads or medusa.heads_dir or medusa.heads, tree, compiled)
              for name, heads, tree, compiled in specs}
    report = benchmark(medusa, questions, config, accuracy=calibration.accuracy if calibration else None, sweep=sweep,
                       llama=llama, repeat=args.repeat, rivals=rivals, raw=args.raw)
    report["config"].update(model=args.model or DEFAULT_MODEL.name, heads=args.heads, questions=args.questions,
                            categories=categories, limit=args.limit, per_category=args.per_category,
                            heads_trained=heads_trained(medusa.heads), kind=medusa.heads.config.kind)
    report["config"]["rivals"] = {name: {"heads": str(view.heads_dir), "kind": view.heads.config.kind,
                                         "tree": spec, "confident": view.trees.confident, "compiled": view.compiled}
                                  for (name, _, spec, _), view in zip(specs, rivals.values())}
    print(table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=1)
    if args.plot:
        plot(report, args.plot)


def rival_specs(specs: list[str]) -> list[tuple[str, str | None, str, bool | None]]:
    """--rival NAME=[DIR][@TREE][+ENGINE] -> (name, heads directory or None, tree, compiled engine or None)."""
    from .bench import DECODERS, LLAMA_CPP

    out = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        rest, plus, engine = rest.partition("+")
        heads, _, tree = rest.partition("@")
        if not name or not (rest or plus) or name in DECODERS + (LLAMA_CPP,) or name in {n for n, *_ in out}:
            raise ValueError(f"--rival: NAME=[DIR][@TREE][+ENGINE] with a new name, got {spec!r}")
        if plus and engine not in ENGINES:
            raise ValueError(f"--rival: the engine after + is one of {ENGINES}, got {engine!r} in {spec!r}")
        out.append((name, heads or None, tree or "auto", engine == "compiled" if plus else None))
    return out


def bench_serving(args, prompts: list[str], config: GenerationConfig) -> None:
    """`medusa bench --concurrency`: the server under load (loadtest.py)."""
    import torch

    from . import loadtest
    from .calibrate import device_name

    try:
        concurrency = tuple(sorted({int(n) for n in args.concurrency.split(",")}))
    except ValueError:
        raise ValueError(f"concurrency: comma-separated client counts, got {args.concurrency!r}") from None
    report = loadtest.load_benchmark(lambda: load(args), prompts, concurrency, args.requests_per_client, config,
                                     args.seconds, repeat=args.repeat)
    report["device"] = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    report["config"].update(model=args.model or DEFAULT_MODEL.name, heads=args.heads, tree=args.tree,
                            kernels=args.kernels, questions=args.questions)
    print(loadtest.table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=1)
    if args.plot:
        loadtest.plot(report, args.plot)


def cmd_calibrate(args) -> None:
    from .calibrate import PLOT_NAMES, calibrate, save, setup
    from .formats import CALIBRATION_NAME

    if args.limit is not None and args.limit < 1:
        raise ValueError(f"limit must be a positive integer, got {args.limit!r}")
    config = CalibrateConfig(max_nodes=args.max_nodes, max_positions=args.max_positions, guess_vocab=args.guess_vocab)
    conversations = read_data(args.data)[: args.limit]  # before the model loads: bad data fails at once
    vocab_conversations = read_data(args.vocab_data) if args.vocab_data else None
    medusa = load(args)
    result = calibrate(medusa, conversations, config, vocab_conversations)
    print("accuracy a_k^(i): P(head k's rank-i token is correct)")
    print("        " + "".join(f"{f'r{i}':>7}" for i in range(len(result.accuracy[0]))))
    for k, row in enumerate(result.accuracy):
        print(f"head {k:<3}" + "".join(f"{a:>7.3f}" for a in row))
    middle = result.contexts[len(result.contexts) // 2]
    print(f"\nstep ms at contexts of {', '.join(map(str, result.contexts))} tokens; tokens/s predicted at {middle}")
    print("tokens/step: predicted from the table; simulated on the data for the static and the confident tree")
    print(f"{'size':>4} {'tokens/step':>11} {'simulated':>9} {'confident':>9} "
          + "".join(f"{f'ms @{c}':>10}" for c in result.contexts) + f"{'tokens/s':>10}")
    for i, (n, tokens, speed) in enumerate(zip(result.sizes, result.expected_tokens, result.tokens_per_s)):
        latencies = "".join(f"{1000 * row[i]:>10.2f}" for row in result.latency_s)
        print(f"{n:>4} {tokens:>11.3f} {result.simulated_tokens[i]:>9.3f} {result.confident_tokens[i]:>9.3f} "
              f"{latencies}{speed:>10.1f}{'  <- chosen' if n == result.size else ''}")
    output = args.output or args.heads
    save(result, output, setup(medusa))
    chosen = result.tokens_per_s[result.sizes.index(result.size)]
    print(f"calibrate: a tree of {result.size} candidates, predicted {chosen:.1f} tokens/s at {middle} tokens "
          f"(plain {result.tokens_per_s[0]:.1f}) on {setup(medusa)} -> {output}/tree.json, {CALIBRATION_NAME}, "
          f"{', '.join(PLOT_NAMES.values())}; `--tree auto` moves between the sizes step by step", file=sys.stderr)
    if result.confident_size is not None:
        i = result.sizes.index(result.confident_size)
        print(f"calibrate: confident trees (`--tree confident`) decode fastest at {result.confident_size} candidates, "
              f"{result.confident_tokens[i]:.2f} tokens per step, predicted "
              f"{result.confident_tokens[i] / result.latency_s[len(result.contexts) // 2][i]:.1f} tokens/s", file=sys.stderr)
    if result.tokens_per_s[0] > chosen:
        print("calibrate: plain decoding is predicted faster on this device: the heads' guesses do not pay for "
              "the extra work (train them longer, or decode plainly: GenerationConfig(medusa=False))", file=sys.stderr)


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
        help="the heads' learning rate; medusa2's LoRA gets lr / 4")
    add("--batch-size", type=int, default=TRAIN.batch_size)
    add("--grad-accum", dest="gradient_accumulation_steps", metavar="N", type=int, default=TRAIN.gradient_accumulation_steps)
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
        help="medusa1, shared projection: rank the N tokens the answers use most in the heads' loss (0: all; 4096 "
             "makes a CPU step ~2.5x faster)")
    add("--position-batch", type=int, default=TRAIN.position_batch, metavar="N",
        help="medusa1: compute the frozen backbone's states at the answer positions once, then train on shuffled "
             "batches of N positions (e.g. 256: many more updates per hour than batches of conversations)")
    add("--quantize", choices=QUANTIZATIONS, default=TRAIN.quantize, help="medusa1: frozen backbone in 8/4 bit (GPU)")
    add("--bf16", action="store_true", help="backbone in bfloat16, mixed-precision training")
    add("--eval-fraction", type=float, default=TRAIN.eval_fraction, help="held out for per-head accuracy")
    add("--save-steps", type=int, default=TRAIN.save_steps, help="checkpoint and evaluate every this many steps")
    add("--seed", type=int, default=TRAIN.seed)
    add("--init-heads", help="start from these trained heads instead of fresh ones (MEDUSA heads may start hydra "
        "heads, and heads may start deeper ones: --num-layers more; the new weights start at zero, the logits unchanged)")
    add("--resume", action="store_true", help="continue from the last checkpoint in OUTPUT/checkpoints (with "
        "--position-batch, states already computed in OUTPUT/states are read back whether or not)")
    add("--merge", action="store_true", help="medusa2: also write the merged model to OUTPUT/model")


def read_data(paths: list[str]) -> list[list[dict]]:
    """The conversations of every --data file, in order."""
    from .training.data import read_conversations

    return [chat for path in paths for chat in read_conversations(path)]


def cmd_corpus(args) -> None:
    from tqdm.auto import tqdm

    from .base import load_base
    from .corpus import CORPUS_NAME, CorpusIndex
    from .training.data import IGNORE_INDEX, build_examples

    if not Path(args.heads).is_dir():
        raise FileNotFoundError(f"heads directory {args.heads} does not exist")
    conversations = read_data(args.data)  # before the model loads: bad data fails at once
    tokenizer = load_base(args.model)[1]
    examples = build_examples(tokenizer, tqdm(conversations, desc="tokenizing", unit="conv"), CALIBRATE.max_length)
    index = CorpusIndex.build(((e["input_ids"], [label != IGNORE_INDEX for label in e["labels"]]) for e in examples),
                              args.min_seen)
    index.save(args.heads)
    print(f"corpus: {len(index.keys)} contexts from the answers of {len(examples)} conversations -> "
          f"{Path(args.heads) / CORPUS_NAME}", file=sys.stderr)


def cmd_train(args) -> None:
    import torch.distributed

    from .training.train import load_backbone, train

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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="medusa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("demo", help="answer a few prompts on the embedded default, MEDUSA vs plain")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MODEL.demo_max_new_tokens)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("export", help="write heads (any layout) in vLLM's or the reference MEDUSA layout")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--heads", help="heads directory, any layout (default: the embedded default's MEDUSA heads)")
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("chat", help="multi-turn chat in the terminal: /reset, /stats, /exit")
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions")
    add_model_arguments(p)
    p.add_argument("--host", default=SERVER.host)
    p.add_argument("--port", type=int, default=SERVER.port)
    p.add_argument("--max-batch", type=int, default=SERVER.max_batch, help="requests decoded together")
    p.add_argument("--max-queue", type=int, default=SERVER.max_queue,
                   help="requests that may wait beyond those; more get a 503")
    p.add_argument("--max-tree-nodes", type=int, default=SERVER.max_tree_nodes,
                   help="the most candidates a request's medusa.tree may ask for; larger trees get a 400")
    p.add_argument("--max-tree-depth", type=int, default=SERVER.max_tree_depth,
                   help="the deepest tree a request may ask for")
    p.add_argument("--api-key", help=f"every /v1/ request must send it (Authorization: Bearer KEY; the chat page asks "
                   f"for it once); default ${API_KEY_ENV}, else none")
    p.set_defaults(run=cmd_serve)

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

    p = sub.add_parser("corpus", help="index the model's own answers beside the heads: its corpus drafts (corpus.py)")
    p.add_argument("--data", required=True, nargs="+", help=DATA_HELP + "; the answers the model gave (never a "
                   "benchmark's)")
    p.add_argument("--heads", required=True, help="MEDUSA heads directory: the index goes beside them")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--min-seen", type=int, default=CORPUS_MIN_SEEN, help="keep contexts seen at least this often")
    p.set_defaults(run=cmd_corpus)

    p = sub.add_parser("train", help="train MEDUSA heads (medusa1) or heads + LoRA backbone (medusa2)")
    p.add_argument("--data", required=True, nargs="+", help=DATA_HELP)
    p.add_argument("--output", required=True, help="directory for the heads, checkpoints/ and head_accuracy.json")
    add_model_arguments(p, heads=False, kernels=False)
    add_train_arguments(p)
    p.set_defaults(run=cmd_train)

    p = sub.add_parser("bench", help="MT-Bench-style benchmark: MEDUSA vs plain decoding vs transformers generate")
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    p.add_argument("--questions", required=True, nargs="+",
                   help="JSONL files: {question_id, category, turns: [...]} per line (several are read in order)")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    p.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    p.add_argument("--acceptance", choices=ACCEPTANCE_RULES + ("auto",), default=DEFAULTS.acceptance)
    p.add_argument("--seed", type=int, default=DEFAULTS.seed)
    add_draft_arguments(p)
    p.add_argument("--limit", type=int, help="only the first N questions (after --categories)")
    p.add_argument("--categories", help="comma-separated categories to keep, e.g. writing,coding")
    p.add_argument("--per-category", type=int, help="only the first N questions of each category (a balanced sample)")
    p.add_argument("--json", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG here: tokens/s by category, and tokens per MEDUSA step")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's; use 1 on a busy, shared CPU)")
    p.add_argument("--repeat", type=int, default=1, help="run every turn (with --concurrency: every load) this many "
                   "times with each decoder and count the fastest (a shared machine's noise only slows runs; --sweep "
                   "runs once)")
    p.add_argument("--sweep", help="also run MEDUSA with the calibrated tree of each of these sizes, e.g. 1,2,4,8,16,32,64, "
                   "and plot measured vs predicted speed (needs calibrated heads)")
    p.add_argument("--rival", action="append", default=[], metavar="NAME=[DIR][@TREE][+ENGINE]",
                   help="also run MEDUSA with other heads (DIR; default: --heads'), another tree (auto, confident, "
                   "confident:N, a JSON tree: [] is plain decoding; default auto) and/or on the other engine "
                   "(+compiled, +eager) on the same model, side by side, e.g. hydra=heads/hydra, "
                   "confident=@confident or compiled=+compiled; repeatable. Calibrate all heads on the same data "
                   "(the guess vocabulary is the model's)")
    p.add_argument("--concurrency", metavar="N,N,...",
                   help="instead: the server under load over HTTP, e.g. 1,4,8,16 concurrent clients (first turns as "
                   "prompts): MEDUSA and plain batching against one request at a time; tokens/s, latency, errors")
    p.add_argument("--requests-per-client", type=int, default=4, help="with --concurrency: requests each client sends")
    p.add_argument("--seconds", type=float, default=600, help="with --concurrency: no request starts after this, per run")
    p.add_argument("--llama-cpp", nargs="?", const="", metavar="GGUF",
                   help="also time llama.cpp (llama-cpp-python, an optional extra) on this GGUF file (default: the "
                   "model's own, where --model is a GGUF file, else the embedded default's), greedy, and both engines' step over "
                   "1/4/8/16 tokens")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("calibrate", help="measure head accuracy and step latency; write the fastest tree beside the heads")
    p.add_argument("--data", required=True, nargs="+", help=DATA_HELP)
    p.add_argument("--heads", required=True, help="MEDUSA heads directory")
    add_model_arguments(p, heads=False)
    p.add_argument("--max-nodes", type=int, default=CALIBRATE.max_nodes, help="largest tree tried (candidates)")
    p.add_argument("--max-positions", type=int, default=CALIBRATE.max_positions, help="answer tokens measured")
    p.add_argument("--guess-vocab", type=int, default=CALIBRATE.guess_vocab,
                   help="on a CPU the heads guess from the N tokens the data's answers use most (0: all)")
    p.add_argument("--vocab-data", nargs="+", help="count the guess vocabulary on these conversations' answers "
                   "instead (the heads' training data: the vocabulary their training ranked)")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--output", help="where tree.json, accuracy.json and the plots go (default: the heads directory)")
    p.set_defaults(run=cmd_calibrate, tree=None)  # load() reads --tree; calibration makes the tree

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, OSError, ModuleNotFoundError) as error:  # the last: an optional extra missing
        print(f"medusa {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, as a shell command does
        print(file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
