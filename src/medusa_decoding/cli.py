"""`medusa` command line: one small function per subcommand, all built from config.py's defaults."""

import argparse
import json
import sys
from dataclasses import fields

from .config import ACCEPTANCE_RULES, DEFAULT_MODEL, EXPORT_FORMATS, GenerationConfig, ServerConfig

DEFAULTS = GenerationConfig()
SERVER = ServerConfig()


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="base model directory or hub id (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--heads", help="MEDUSA heads directory (default: shipped heads, else untrained)")
    parser.add_argument("--tree", help="tree: JSON path list, Cartesian sizes, or a JSON file")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    parser.add_argument("--top-p", type=float, default=DEFAULTS.top_p)
    parser.add_argument("--top-k", type=int, default=DEFAULTS.top_k)
    parser.add_argument("--acceptance", choices=ACCEPTANCE_RULES + ("auto",), default=DEFAULTS.acceptance)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)


def load(args):
    from .model import MedusaModel
    from .tree import parse_spec

    tree = parse_spec(args.tree) if args.tree else None
    return MedusaModel.from_pretrained(args.model, args.heads, tree=tree)


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
            "tokens_per_s": out.tokens_per_s,
        }
        print(json.dumps(record))
        return
    for piece in medusa.stream(args.prompt, config=config, raw=args.raw):
        print(piece, end="", flush=True)
    print()


def cmd_demo(args) -> None:
    medusa = load(args)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    print(f"model: {medusa.model.name_or_path}  heads: {medusa.heads.config.num_heads} "
          f"  tree: {medusa.tree.num_nodes - 1} nodes\n")
    rows = []
    for prompt in DEFAULT_MODEL.demo_prompts:
        print(f">>> {prompt}")
        for piece in medusa.stream(prompt, config=config):
            print(piece, end="", flush=True)
        print()
        out = medusa.generate(prompt, config=config)
        plain = medusa.generate(prompt, config=config, medusa=False)
        rows.append((out, plain))
        print(f"    MEDUSA {out.tokens_per_s:6.1f} tok/s ({out.acceleration_rate:.2f} tokens/step)   "
              f"plain {plain.tokens_per_s:6.1f} tok/s   identical: {out.token_ids == plain.token_ids}\n")


def cmd_export(args) -> None:
    from .formats import export

    medusa = load(args)  # heads in any layout; the base model supplies a shared LM head and the vocab size
    export(medusa.heads, args.out, args.format, medusa.model.get_output_embeddings())
    print(f"wrote {medusa.heads.config.num_heads} heads in the {args.format} layout to {args.out}")


def cmd_chat(args) -> None:
    from .chat import chat

    try:
        chat(load(args), generation_config(args))
    except KeyboardInterrupt:  # Ctrl-C while the model loads: leave as quietly as chat() does
        print()


def cmd_serve(args) -> None:
    import uvicorn

    from .server import create_app

    medusa = load(args)
    uvicorn.run(create_app(medusa, args.model or DEFAULT_MODEL.name), host=args.host, port=args.port)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="medusa", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=cmd_generate)

    p = sub.add_parser("demo", help="answer a few prompts on the embedded default, MEDUSA vs plain")
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("export", help="write heads (any layout) in vLLM's or the reference MEDUSA layout")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS)
    add_model_arguments(p)
    p.set_defaults(run=cmd_export)

    p = sub.add_parser("chat", help="multi-turn chat in the terminal: /reset, /stats, /exit")
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server: /v1/chat/completions, /v1/completions")
    add_model_arguments(p)
    p.add_argument("--host", default=SERVER.host)
    p.add_argument("--port", type=int, default=SERVER.port)
    p.set_defaults(run=cmd_serve)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"medusa {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
