"""`medusa` command line: one small function per subcommand, all built from config.py's defaults."""

import argparse
import json
import os
import sys
import time

from ..config import DEFAULT_MODEL, EXPORT_FORMATS, ServerConfig
from . import measure, training
from .arguments import (
    MODEL_HELP,
    RAW_HELP,
    SERVER,
    add_model_arguments,
    add_sampling_arguments,
    generation_config,
    load,
)

API_KEY_ENV = "MEDUSA_API_KEY"  # `medusa serve --api-key`'s default, kept out of the process list


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


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=cmd_generate)


def cmd_export(args) -> None:
    """Nothing runs: the heads from their files (any layout), the base model only for its LM head and vocabulary. The
    embedded default's MEDUSA heads unless --heads names others (its default hydra heads have no such layout)."""
    from .. import embedded
    from ..base import load_base
    from ..formats import export
    from ..heads import MedusaHeads

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


def add_export(sub) -> None:
    p = sub.add_parser("export", help="write heads (any layout) in vLLM's or the reference MEDUSA layout")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--heads", help="heads directory, any layout (default: the embedded default's MEDUSA heads)")
    p.set_defaults(run=cmd_export)


def cmd_chat(args) -> None:
    from ..chat import chat

    try:
        chat(load(args), generation_config(args), raw=args.raw)
    except KeyboardInterrupt:  # Ctrl-C while the model loads: leave as quietly as chat() does
        print()


def add_chat(sub) -> None:
    p = sub.add_parser("chat", help="multi-turn chat in the terminal: /reset, /stats, /exit")
    p.add_argument("--raw", action="store_true", help=RAW_HELP)
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=cmd_chat)


def cmd_serve(args) -> None:
    import uvicorn

    from ..server import Scheduler, create_app

    config = ServerConfig(args.host, args.port, args.max_batch, args.max_queue, args.max_tree_nodes,
                          args.max_tree_depth, args.api_key or os.environ.get(API_KEY_ENV) or None)
    scheduler = Scheduler(config.max_batch, config.max_queue)
    medusa = scheduler.load(lambda: load(args))  # on the thread that will run it (Scheduler says why)
    uvicorn.run(create_app(medusa, args.model or DEFAULT_MODEL.name, scheduler, config), host=config.host,
                port=config.port)


def add_serve(sub) -> None:
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


# every subcommand, in the order `medusa --help` lists them
SUBCOMMANDS = (add_generate, measure.add_demo, add_export, add_chat, add_serve, training.add_distill,
               training.add_corpus, training.add_train, measure.add_bench, measure.add_calibrate)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="medusa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    # ModuleNotFoundError: an optional extra missing
    except (ValueError, FileNotFoundError, OSError, ModuleNotFoundError) as error:
        print(f"medusa {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # Ctrl-C: stop quietly, as a shell command does
        print(file=sys.stderr)
        sys.exit(130)
