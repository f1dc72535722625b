"""The subcommands that time decoding and print what they measured: demo, bench (and its --concurrency load test),
calibrate."""

import json
import sys
import time

from ..config import ACCEPTANCE_RULES, DEFAULT_MODEL, CalibrateConfig, GenerationConfig
from ..kernels import ENGINES
from .arguments import (
    CALIBRATION,
    DATA_HELP,
    GENERATION,
    RAW_HELP,
    add_draft_arguments,
    add_model_arguments,
    generation_config,
    load,
    read_data,
)

UNTRAINED = (
    "heads: UNTRAINED. Fresh heads only repeat the base model's next-token guess, so almost no guess is\n"
    "accepted: this run shows that the machinery works and is lossless, not a speedup (expect MEDUSA to be\n"
    "somewhat slower than plain decoding). Train heads with `medusa distill` + `medusa train`, then --heads DIR."
)


def heads_trained(heads) -> bool:
    """Fresh heads keep every residual block at its zero init; training moves them."""
    from ..heads import ResBlock

    return any(bool(block.linear.weight.any()) for block in heads.modules() if isinstance(block, ResBlock))


def combined(outputs: list):
    """Several GenerationOutputs as one: their tokens, forward passes and seconds added up."""
    from ..model import GenerationOutput

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
            f"{plain.tokens_per_s:>11.1f} {hf.tokens_per_s:>8.1f} {speedup:>7.2f}x {vs_hf:>6.2f}x  "
            f"{'yes' if identical else 'NO'}")


def cmd_demo(args) -> None:
    from transformers import TextStreamer

    from ..bench import hf_generate
    from ..calibrate import setup

    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    medusa = load(args)
    trained = heads_trained(medusa.heads)
    trees = medusa.trees.trees
    choice = (f"trees of {trees[0].num_nodes - 1} to {trees[-1].num_nodes - 1} candidates, picked each step by what "
              "pays (plain first)" if len(trees) > 1 else f"a tree of {medusa.tree.num_nodes - 1} candidates")
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
          "decoding in the same engine; vs HF: vs transformers generate on stock kernels (what transformers alone "
          "gives)")


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="answer a few prompts on the embedded default, MEDUSA vs plain")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MODEL.demo_max_new_tokens)
    p.set_defaults(run=cmd_demo)


def cmd_bench(args) -> None:
    import torch

    from .. import llamacpp
    from ..base import context_limit, gguf_of
    from ..bench import benchmark, plot, read_questions, table
    from ..calibrate import read_accuracy

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
    llama = (None if args.llama_cpp is None
             else llamacpp.load(gguf, torch.get_num_threads(), context_limit(medusa.model)))
    if not heads_trained(medusa.heads):
        print(UNTRAINED, file=sys.stderr)
    calibration = read_accuracy(medusa.heads_dir) if medusa.heads_dir else None  # predictions need it
    rivals = {name: medusa.with_heads(heads or medusa.heads_dir or medusa.heads, tree, engine)
              for name, heads, tree, engine in specs}
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


def rival_specs(specs: list[str]) -> list[tuple[str, str | None, str, str | None]]:
    """--rival NAME=[DIR][@TREE][+ENGINE] -> (name, heads directory or None, tree, engine or None: the model's)."""
    from ..bench import DECODERS, LLAMA_CPP

    out = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        rest, plus, engine = rest.partition("+")
        heads, _, tree = rest.partition("@")
        if not name or not (rest or plus) or name in DECODERS + (LLAMA_CPP,) or name in {n for n, *_ in out}:
            raise ValueError(f"--rival: NAME=[DIR][@TREE][+ENGINE] with a new name, got {spec!r}")
        if plus and engine not in ENGINES[1:]:
            raise ValueError(f"--rival: the engine after + is one of {ENGINES[1:]}, got {engine!r} in {spec!r}")
        out.append((name, heads or None, tree or "auto", engine if plus else None))
    return out


def bench_serving(args, prompts: list[str], config: GenerationConfig) -> None:
    """`medusa bench --concurrency`: the server under load (loadtest.py)."""
    import torch

    from .. import loadtest
    from ..calibrate import device_name

    try:
        concurrency = tuple(sorted({int(n) for n in args.concurrency.split(",")}))
    except ValueError:
        raise ValueError(f"concurrency: comma-separated client counts, got {args.concurrency!r}") from None
    report = loadtest.load_benchmark(lambda: load(args), prompts, concurrency, args.requests_per_client, config,
                                     args.seconds, repeat=args.repeat)
    report["device"] = device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    report["config"].update(model=args.model or DEFAULT_MODEL.name, heads=args.heads, tree=args.tree,
                            kernels=args.kernels, engine=args.engine, questions=args.questions)
    print(loadtest.table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(report, file, indent=1)
    if args.plot:
        loadtest.plot(report, args.plot)


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="MT-Bench-style benchmark: MEDUSA vs plain decoding vs transformers generate")
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    p.add_argument("--questions", required=True, nargs="+",
                   help="JSONL files: {question_id, category, turns: [...]} per line (several are read in order)")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=GENERATION.max_new_tokens)
    p.add_argument("--temperature", type=float, default=GENERATION.temperature)
    p.add_argument("--top-p", type=float, default=GENERATION.top_p)
    p.add_argument("--acceptance", choices=ACCEPTANCE_RULES + ("auto",), default=GENERATION.acceptance)
    p.add_argument("--seed", type=int, default=GENERATION.seed)
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
    p.add_argument("--sweep", help="also run MEDUSA with the calibrated tree of each of these sizes, e.g. "
                   "1,2,4,8,16,32,64, and plot measured vs predicted speed (needs calibrated heads)")
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
    p.add_argument("--seconds", type=float, default=600,
                   help="with --concurrency: no request starts after this, per run")
    p.add_argument("--llama-cpp", nargs="?", const="", metavar="GGUF",
                   help="also time llama.cpp (llama-cpp-python, an optional extra) on this GGUF file (default: the "
                   "model's own, where --model is a GGUF file, else the embedded default's), greedy, and both "
                   "engines' step over 1/4/8/16 tokens")
    p.set_defaults(run=cmd_bench)


def cmd_calibrate(args) -> None:
    from ..calibrate import PLOT_NAMES, calibrate, save, setup
    from ..formats import CALIBRATION_NAME

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
              f"{result.confident_tokens[i] / result.latency_s[len(result.contexts) // 2][i]:.1f} tokens/s",
              file=sys.stderr)
    if result.tokens_per_s[0] > chosen:
        print("calibrate: plain decoding is predicted faster on this device: the heads' guesses do not pay for "
              "the extra work (train them longer, or decode plainly: GenerationConfig(medusa=False))", file=sys.stderr)


def add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate",
                       help="measure head accuracy and step latency; write the fastest tree beside the heads")
    p.add_argument("--data", required=True, nargs="+", help=DATA_HELP)
    p.add_argument("--heads", required=True, help="MEDUSA heads directory")
    add_model_arguments(p, heads=False)
    p.add_argument("--max-nodes", type=int, default=CALIBRATION.max_nodes, help="largest tree tried (candidates)")
    p.add_argument("--max-positions", type=int, default=CALIBRATION.max_positions, help="answer tokens measured")
    p.add_argument("--guess-vocab", type=int, default=CALIBRATION.guess_vocab,
                   help="on a CPU the heads guess from the N tokens the data's answers use most (0: all)")
    p.add_argument("--vocab-data", nargs="+", help="count the guess vocabulary on these conversations' answers "
                   "instead (the heads' training data: the vocabulary their training ranked)")
    p.add_argument("--limit", type=int, help="only the first N conversations")
    p.add_argument("--output", help="where tree.json, accuracy.json and the plots go (default: the heads directory)")
    p.set_defaults(run=cmd_calibrate, tree=None)  # load() reads --tree; calibration makes the tree
