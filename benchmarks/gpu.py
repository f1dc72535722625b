"""The GPU benchmark: what the compiled engine gives on one GPU, in one command (meant to take under 10 minutes).

1. The bandwidth floor of a 7B-shaped Llama (random weights, bfloat16): its weight bytes over the device's measured
   copy bandwidth, the least time any engine can take for a one-token step.
2. That model's full decoding step (decoding.Batch: guess, verify, accept, commit) of plain decoding and of trees of
   16/32/64/128 nodes, at a 512-token context, on the eager and the compiled engine (calibrate.measure_step_latency).
3. SmolLM2-135M-Instruct with its shipped heads, end to end on held-out prompts: MEDUSA and plain decoding on the
   compiled engine, and `transformers` `generate` with its own static cache compiled; greedy, so MEDUSA must give
   plain decoding's tokens (lossless) and the report says whether it did.
Prints a table, writes PREFIX.json and PREFIX.png.

usage: python benchmarks/gpu.py [--out benchmarks/results/gpu] [--small] [--nodes 16 32 64 128]
On the lent GPU (DEVELOPERS.md): `source /root/medusa-gpu/env.sh && PYTHONPATH=src:$PYTHONPATH python3 benchmarks/gpu.py`
(MEDUSA_GGUF points at the carried model). `--small` swaps the 7B shape for a tiny one: a CPU check of the script.
"""

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
import transformers

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding.bench import read_questions
from medusa_decoding.calibrate import device_name, greedy_trees, measure_step_latency, read_accuracy, synchronize
from medusa_decoding.config import CalibrateConfig, HeadsConfig
from medusa_decoding.default_model import shipped_heads
from medusa_decoding.heads import MedusaHeads
from medusa_decoding.model import GenerationOutput

PROMPTS = Path(__file__).with_name("prompts") / "held_out.jsonl"
SHAPE_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
SHAPE_SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=32000)
CONTEXT, NEW_TOKENS, TURNS = 512, 256, 8
SMOL_CANDIDATES = 63  # SmolLM2's tree: the greedy tree of 64 nodes from its heads' calibration


def copy_bandwidth(device: torch.device) -> float:
    """Bytes a second the device moves in a large copy (read + written), best of 10."""
    source = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    target, best = torch.empty_like(source), float("inf")
    for _ in range(10):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() / best


def random_llama(shape: dict, device: torch.device):
    """A Llama of `shape` with small random bfloat16 weights, on `device`, and heads of the MEDUSA layout for it."""
    config = transformers.LlamaConfig(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):  # initialised where it runs (transformers' own init: normal, std 0.02)
        model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    heads = MedusaHeads(HeadsConfig(shape["hidden_size"], shape["vocab_size"], 4)).to(device, torch.bfloat16)
    return model, heads


def step_latencies(model, heads, nodes: list[int]) -> dict:
    """{engine: [seconds of plain, then of each tree size]} on the eager and the compiled engine."""
    # a tree of each size from a plausible accuracy table (head k's rank i right 0.6^(k+1) / (i+1) of the time)
    accuracy = torch.tensor([[0.6 ** (k + 1) / (i + 1) for i in range(64)] for k in range(4)], dtype=torch.float64)
    trees = greedy_trees(accuracy, [0] + [n - 1 for n in nodes])
    timing = CalibrateConfig(latency_contexts=(CONTEXT,), latency_repeats=10)
    latencies = {}
    for engine in ("eager", "compiled"):  # the same modules (stock kernels off a CPU in float32), two engines
        engine_view = SimpleNamespace(model=model, heads=heads, compiled=engine == "compiled")
        _, (latencies[engine],) = measure_step_latency(engine_view, trees, timing)
    return latencies


def static_generate(model, ids: torch.Tensor, new_tokens: int) -> GenerationOutput:
    """`transformers`' own fast path: generate with a static cache, which it compiles itself."""
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids[None], attention_mask=torch.ones_like(ids)[None], max_new_tokens=new_tokens,
                             do_sample=False, cache_implementation="static", pad_token_id=0)
    new = out[0, len(ids):].tolist()
    return GenerationOutput(token_ids=new, accept_lengths=[1] * len(new), text="", seconds=time.perf_counter() - start)


def end_to_end(device: torch.device, turns: int) -> dict:
    """SmolLM2 with its shipped heads: tokens/s of MEDUSA, plain (compiled engine) and static-cache generate."""
    heads_dir = shipped_heads()
    tree = greedy_trees(read_accuracy(heads_dir).accuracy, [SMOL_CANDIDATES])[0]
    medusa = MedusaModel.from_pretrained(heads=heads_dir, tree=tree, device=device, kernels="compiled")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    decoders = {"medusa": lambda ids: medusa.generate(ids, config=config),
                "plain": lambda ids: medusa.generate(ids, config=replace(config, medusa=False)),
                "generate (static, compiled)": lambda ids: static_generate(medusa.model, ids, NEW_TOKENS)}
    prompts = [medusa.encode(messages=[{"role": "user", "content": q.turns[0]}]) for q in read_questions([PROMPTS])]
    outputs = {name: [] for name in decoders}
    for number, ids in enumerate(prompts[: turns + 1]):  # the first compiles, off the clock
        for name, decode in decoders.items():
            out = decode(ids)
            if number:
                outputs[name].append(out)
    return {"tree_nodes": tree.num_nodes, "turns": turns,
            "lossless": all(m.token_ids == p.token_ids for m, p in zip(outputs["medusa"], outputs["plain"])),
            "tokens_per_s": {name: sum(len(o.token_ids) for o in outs) / sum(o.seconds for o in outs)
                             for name, outs in outputs.items()},
            "tokens_per_step": {name: sum(len(o.token_ids) for o in outs) / sum(o.steps for o in outs)
                                for name, outs in outputs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu", help="PREFIX of PREFIX.json and PREFIX.png")
    parser.add_argument("--small", action="store_true", help="a tiny model in place of the 7B shape (a quick check)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[16, 32, 64, 128], help="tree sizes timed")
    parser.add_argument("--turns", type=int, default=TURNS, help="held-out prompts decoded end to end")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPE_SMALL if args.small else SHAPE_7B
    model, heads = random_llama(shape, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    latencies = step_latencies(model, heads, args.nodes)
    del model, heads
    report = {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
              "shape": shape, "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth,
              "floor_s": weight_bytes / bandwidth, "context": CONTEXT, "nodes": [1, *args.nodes],
              "step_s": latencies, "smollm2": end_to_end(device, args.turns)}
    print(table(report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, f"{args.out}.png")


def table(report: dict) -> str:
    floor, compiled = report["floor_s"], report["step_s"]["compiled"]
    lines = [f"{report['device']}; torch {report['torch']}, transformers {report['transformers']}",
             f"Llama of {report['shape']['num_hidden_layers']} layers x {report['shape']['hidden_size']} (random "
             f"weights), step at a {report['context']}-token context; bandwidth floor {floor * 1e3:.2f} ms "
             f"({report['weight_bytes'] / 1e9:.1f} GB at {report['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)",
             "| nodes | eager (ms) | compiled (ms) | compiled / floor | compiled / plain |", "| --- | --- | --- | --- | --- |"]
    for i, nodes in enumerate(report["nodes"]):
        eager, fast = report["step_s"]["eager"][i], compiled[i]
        lines.append(f"| {nodes} | {eager * 1e3:.2f} | {fast * 1e3:.2f} | {fast / floor:.2f} | {fast / compiled[0]:.2f} |")
    smol = report["smollm2"]
    lines += ["", f"SmolLM2-135M, shipped heads, {smol['tree_nodes']}-node tree, {smol['turns']} held-out prompts, "
              f"{NEW_TOKENS} tokens, greedy; MEDUSA lossless: {smol['lossless']}",
              "| decoder | tokens/s | tokens/step |", "| --- | --- | --- |"]
    lines += [f"| {name} | {speed:.1f} | {smol['tokens_per_step'][name]:.2f} |"
              for name, speed in smol["tokens_per_s"].items()]
    plain = smol["tokens_per_s"]["plain"]
    lines.append(f"MEDUSA: {smol['tokens_per_s']['medusa'] / plain:.2f}x plain, "
                 f"{smol['tokens_per_s']['medusa'] / smol['tokens_per_s']['generate (static, compiled)']:.2f}x "
                 "static compiled generate")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (steps, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for engine, seconds in report["step_s"].items():
        steps.plot(report["nodes"], [s * 1e3 for s in seconds], marker="o", label=engine)
    steps.axhline(report["floor_s"] * 1e3, color="gray", linestyle="--", label="bandwidth floor")
    steps.set(xscale="log", xlabel="tree nodes (1: plain)", ylabel="step (ms)",
              title=f"Llama {report['shape']['num_hidden_layers']} x {report['shape']['hidden_size']} step")
    steps.legend()
    names = list(report["smollm2"]["tokens_per_s"])
    speed.bar(names, [report["smollm2"]["tokens_per_s"][n] for n in names])
    speed.set(ylabel="tokens/s", title="SmolLM2-135M end to end")
    figure.suptitle(report["device"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
