"""The cost curve of a user's own GGUF model: from SmolLM2-135M and Gemma 3 270M (the embedded models' own files) to
Llama-3.1-8B shapes, our plain decoding step against llama.cpp's on the same file and threads, our MEDUSA step with
1-32 candidates (the heads guessing over 4096 tokens, as calibrated heads do) against our plain step, and the speedup
the tokens a step of real heads (the embedded default's shipped heads, simulated on their calibration data) would
give at each size. The bigger models are Llama-shaped GGUF files of random blocks in llama.cpp's Q4_K_M mix
(random_gguf.py, the embedded model's tokenizer, so a 49,152-token vocabulary: Llama 3's LM head is 2.6x larger): a
step's cost does not depend on the weights' values.

Each instruction set runs in a process of its own (MEDUSA_ISA); JSON, a table and a plot under --out.

    python benchmarks/gguf_cost_curve.py --models smollm2 gemma3 1b 3b 8b --isa avx512 avx2 --kernels q8 native
    python benchmarks/gguf_cost_curve.py --models gemma3 --kernels q8 --engine compiled
"""

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
CANDIDATES = (1, 2, 4, 8, 16, 32)
SHAPES = ("1b", "3b", "8b")
GUESS_VOCAB = 4096  # the tokens the heads guess over (the shipped heads' calibration keeps 4096)
PLAIN_TOKENS = 32  # plain decoding's steps timed after the prompt


def model_file(name: str, folder: Path) -> Path:
    from medusa_decoding import embedded

    if name in ("smollm2", "gemma3"):
        return embedded.gguf_path(embedded.SMOLLM2 if name == "smollm2" else embedded.GEMMA3)
    path = folder / f"random-llama-{name}-Q4_K_M.gguf"
    if not path.is_file():
        sys.path.insert(0, str(HERE))
        import random_gguf

        print(f"writing {path} ...", file=sys.stderr, flush=True)
        random_gguf.write(path, name, "Q4_K_M", tokenizer_from=embedded.gguf_path())
    return path


def tokens_a_step() -> tuple[list, list[float]]:
    """The shipped heads' calibration: its tree order and tokens a step simulated for each static tree size."""
    from medusa_decoding import embedded

    record = json.loads((embedded.SMOLLM2.heads / "accuracy.json").read_text())
    return record["paths"], dict(zip(record["sizes"], record["simulated_tokens"]))


def tokens_at(table: dict, n: int) -> float:
    """Tokens a step of an n-candidate tree: the simulated ones, linear between sizes, the largest beyond."""
    sizes = sorted(table)
    if n >= sizes[-1]:
        return table[sizes[-1]]
    upper = next(s for s in sizes if s >= n)
    lower = max(s for s in sizes if s <= n)
    if upper == lower:
        return table[lower]
    return table[lower] + (table[upper] - table[lower]) * (n - lower) / (upper - lower)


def measure(name: str, path: Path, kernels: str, engine: str, context: int, repeats: int, threads: int) -> dict:
    """One model on one kernel choice and engine, in this process's instruction set."""
    import torch

    from medusa_decoding import MedusaModel, llamacpp
    from medusa_decoding import kernels as ops
    from medusa_decoding.calibrate import measure_step_latency
    from medusa_decoding.config import CalibrateConfig, GenerationConfig
    from medusa_decoding.tree import Tree

    torch.set_num_threads(threads)
    paths, simulated = tokens_a_step()
    start = time.perf_counter()
    medusa = MedusaModel.from_pretrained(path, kernels=kernels, engine=engine, tree=[[0]])
    load_s = time.perf_counter() - start
    engine = "compiled" if medusa.compiled else "eager"  # "auto" as it resolved
    # the heads guess over GUESS_VOCAB tokens, as calibrated heads do (the shipped ones: 4096): untrained heads over a
    # whole vocabulary would time their guesses, not the tree
    ops.set_guess_vocab(medusa.model, torch.arange(GUESS_VOCAB))
    prompt = torch.randint(1000, 20000, (context,), generator=torch.Generator().manual_seed(0))
    plain_steps = []  # plain decoding's steps, no heads: what a step of MEDUSA is weighed against
    for _ in range(repeats):
        out = medusa.generate(prompt, config=GenerationConfig(max_new_tokens=PLAIN_TOKENS + 1, medusa=False))
        plain_steps.append((out.seconds - out.first_token_seconds) / PLAIN_TOKENS)
    plain = statistics.median(plain_steps)
    trees = [Tree.from_spec([tuple(p) for p in paths[:n]]) for n in CANDIDATES]
    config = CalibrateConfig(latency_contexts=(context,), latency_repeats=repeats, batch_sizes=(1,))
    seconds = measure_step_latency(medusa, trees, config)[1][0]
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    del medusa
    gc.collect()
    llama = llamacpp.load(path, threads, context + 64)
    prefix = torch.randint(1000, 20000, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    llama_s = llamacpp.step_latency(llama, prefix, [1, 4], repeats)
    del llama
    return {
        "model": name, "file": str(path), "file_gib": path.stat().st_size / 2**30, "kernels": kernels,
        "engine": engine,
        "isa": ops.variant(), "threads": threads, "context": context, "load_s": load_s, "peak_rss_gib": rss_gib,
        "plain_ms": plain * 1e3, "llama_cpp_ms": llama_s[0] * 1e3, "llama_cpp_4_tokens_ms": llama_s[1] * 1e3,
        "plain_vs_llama_cpp": llama_s[0] / plain,
        "candidates": {n: {"ms": s * 1e3, "vs_plain": s / plain, "tokens_a_step": tokens_at(simulated, n),
                           "predicted_speedup": tokens_at(simulated, n) / (s / plain)}
                       for n, s in zip(CANDIDATES, seconds)},
    }


def plot(results: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost, speed) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        label = f"{r['model']} {r['kernels']} {r.get('engine', '')} {r['isa']}"
        ns = [int(n) for n in r["candidates"]]
        cost.plot(ns, [c["vs_plain"] for c in r["candidates"].values()], marker="o", label=label)
        speed.plot(ns, [c["predicted_speedup"] for c in r["candidates"].values()], marker="o", label=label)
    cost.set(xscale="log", xlabel="candidates verified a step", ylabel="step time / plain step",
             title="What a tree costs")
    speed.set(xscale="log", xlabel="candidates verified a step", ylabel="tokens a step / step cost",
              title="MEDUSA speedup the shipped heads' tokens a step would give")
    speed.axhline(1.0, color="grey", lw=0.8)
    for ax in (cost, speed):
        ax.set_xticks(CANDIDATES, [str(n) for n in CANDIDATES])
        ax.grid(alpha=0.3)
    cost.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def table(results: list[dict]) -> str:
    lines = ["| model | kernels | ISA | file GiB | peak RSS GiB | load s | plain ms | llama.cpp ms | plain vs "
             "llama.cpp | 4 cand. / plain | 8 cand. / plain | best predicted speedup |", "|" + " --- |" * 12]
    for r in results:
        best = max(r["candidates"].items(), key=lambda item: item[1]["predicted_speedup"])
        lines.append(f"| {r['model']} | {r['kernels']} | {r['isa']} | {r['file_gib']:.2f} | {r['peak_rss_gib']:.2f} | "
                     f"{r['load_s']:.1f} | {r['plain_ms']:.1f} | {r['llama_cpp_ms']:.1f} | "
                     f"{r['plain_vs_llama_cpp']:.2f}x | {r['candidates']['4']['vs_plain']:.2f} | "
                     f"{r['candidates']['8']['vs_plain']:.2f} | {best[1]['predicted_speedup']:.2f}x at {best[0]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3", *SHAPES],
                        choices=["smollm2", "gemma3", *SHAPES])
    parser.add_argument("--kernels", nargs="+", default=["q8", "native"])
    parser.add_argument("--engine", default="auto", help="the engine every run decodes on (MedusaModel's engine)")
    parser.add_argument("--isa", nargs="+", default=None, help="instruction sets, each a process (default: this CPU's)")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--files", type=Path, default=Path("/tmp/medusa-gguf-models"), help="where random files go")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "gguf_cost_curve")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.files.mkdir(parents=True, exist_ok=True)
    if args.worker:  # one instruction set: the results as JSON lines on stdout
        for name in args.models:
            path = model_file(name, args.files)
            for kernels in args.kernels:
                record = measure(name, path, kernels, args.engine, args.context, args.repeats, args.threads)
                print(json.dumps(record), flush=True)
        return
    results = []
    for isa in args.isa or [None]:
        env = {**os.environ, **({"MEDUSA_ISA": isa} if isa else {})}
        command = [sys.executable, __file__, "--worker", "--models", *args.models, "--kernels", *args.kernels,
                   "--engine", args.engine, "--context", str(args.context), "--repeats", str(args.repeats),
                   "--threads", str(args.threads), "--files", str(args.files)]
        run = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
        results += [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    print(f"\n{args.out.with_suffix('.json')}, {args.out.with_suffix('.png')}; median of {args.repeats} steps at "
          f"{args.context} tokens of context, {statistics.mode([r['threads'] for r in results])} threads")


if __name__ == "__main__":
    main()
