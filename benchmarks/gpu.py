"""The GPU benchmark: what the compiled engine gives on one GPU, in one command (meant to take under 10 minutes).

1. SmolLM2-135M-Instruct with its shipped heads, end to end on MT-Bench's first turns (`--questions`, `--turns`),
   in each of `--dtypes`: MEDUSA (the heads' calibrated tree of 64 nodes) and plain decoding on the compiled engine,
   and `transformers` `generate` with its own static cache compiled; greedy, so MEDUSA must give plain decoding's
   tokens (lossless) and the report says whether it did. Then a torch profiler over 20 steps of each engine decoder:
   kernels, host and device time per step (PREFIX_profile_DTYPE.txt beside the JSON).
2. The bandwidth floor of a 7B-shaped Llama (random weights, bfloat16): its weight bytes over the device's measured
   copy bandwidth, the least time any engine can take for a one-token step; its full decoding step (decoding.Batch)
   of plain decoding and of trees of `--nodes` nodes at a 512-token context on the compiled engine (`--eager`: on the
   eager one too; calibrate.measure_step_latency).
Prints a table, writes PREFIX.json (after each part: a run stopped short keeps what it measured) and PREFIX.png.

usage: python benchmarks/gpu.py [--out benchmarks/results/gpu] [--small] [--nodes 64] [--parts smollm2 7b] ...
On the lent GPU (DEVELOPERS.md): `source /root/medusa-gpu/env.sh && PYTHONPATH=src:$PYTHONPATH python3 benchmarks/gpu.py
--questions .gpu2/mt_bench_question.jsonl` (MEDUSA_GGUF points at the carried model). `--small` swaps the 7B shape
for a tiny one: a CPU check of the script.
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
from medusa_decoding.embedded import shipped_heads
from medusa_decoding.heads import MedusaHeads
from medusa_decoding.model import GenerationOutput

PROMPTS = Path(__file__).with_name("prompts") / "held_out.jsonl"
SHAPE_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
SHAPE_SMALL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8, vocab_size=32000)
CONTEXT, NEW_TOKENS, TURNS, PROFILED_STEPS = 512, 256, 16, 20
GENERATE = "generate (static, compiled)"
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


def step_latencies(model, heads, nodes: list[int], engines: tuple[str, ...]) -> dict:
    """{engine: [seconds of plain, then of each tree size]} on each of `engines` (eager, compiled)."""
    # a tree of each size from a plausible accuracy table (head k's rank i right 0.6^(k+1) / (i+1) of the time)
    accuracy = torch.tensor([[0.6 ** (k + 1) / (i + 1) for i in range(64)] for k in range(4)], dtype=torch.float64)
    trees = greedy_trees(accuracy, [0] + [n - 1 for n in nodes])
    timing = CalibrateConfig(latency_contexts=(CONTEXT,), latency_repeats=10)
    latencies = {}
    for engine in engines:  # the same modules (stock kernels off a CPU in float32), two engines
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


def end_to_end(device: torch.device, dtype: torch.dtype, questions: Path, turns: int, prefix: str, save,
               generate: bool = True, also: tuple[str, ...] = ()) -> dict:
    """SmolLM2 with its shipped heads in `dtype`: tokens/s and step time of MEDUSA, plain (compiled engine) and
    static-cache generate on the first turns of `questions` (`save`d), then a profile of each engine decoder. also:
    "sampled" (MEDUSA at temperature 0.7, rejection sampling) and "confident" (a confident tree of the same size),
    both on the device step too."""
    heads_dir = shipped_heads()
    tree = greedy_trees(read_accuracy(heads_dir).accuracy, [SMOL_CANDIDATES])[0]
    medusa = MedusaModel.from_pretrained(heads=heads_dir, tree=tree, device=device, dtype=dtype, engine="compiled")
    config = GenerationConfig(max_new_tokens=NEW_TOKENS)
    decoders = {"medusa": lambda ids, n=NEW_TOKENS: medusa.generate(ids, config=replace(config, max_new_tokens=n)),
                "plain": lambda ids, n=NEW_TOKENS: medusa.generate(ids, config=replace(config, max_new_tokens=n,
                                                                                    medusa=False)),
                GENERATE: lambda ids, n=NEW_TOKENS: static_generate(medusa.model, ids, n)}
    if not generate:
        del decoders[GENERATE]
    if "sampled" in also:
        decoders["medusa sampled"] = lambda ids, n=NEW_TOKENS: medusa.generate(
            ids, config=replace(config, max_new_tokens=n, temperature=0.7, seed=0))
    if "confident" in also:
        confident = medusa.with_heads(medusa.heads, f"confident:{SMOL_CANDIDATES}")
        decoders["medusa confident"] = lambda ids, n=NEW_TOKENS: confident.generate(
            ids, config=replace(config, max_new_tokens=n))
    chosen = read_questions([questions], per_category=max(1, turns // 8))[:turns]
    prompts = [medusa.encode(messages=[{"role": "user", "content": q.turns[0]}]) for q in chosen]
    outputs = {name: [] for name in decoders}
    # every turn once off the clock: it compiles every window of attended columns the turns reach (kv.attend)
    for number, ids in enumerate([*prompts, *prompts]):
        for name, decode in decoders.items():
            out = decode(ids)
            if number >= len(prompts):
                outputs[name].append(out)
    result = {"tree_nodes": tree.num_nodes, "turns": len(prompts), "dtype": str(dtype).removeprefix("torch."),
              "lossless": all(m.token_ids == p.token_ids for name in ("medusa", "medusa confident") if name in outputs
                              for m, p in zip(outputs[name], outputs["plain"])),
              "tokens": {name: sum(len(o.token_ids) for o in outs) for name, outs in outputs.items()},
              "tokens_per_s": {name: sum(len(o.token_ids) for o in outs) / sum(o.seconds for o in outs)
                               for name, outs in outputs.items()},
              "tokens_per_step": {name: sum(len(o.token_ids) for o in outs) / sum(o.steps for o in outs)
                                  for name, outs in outputs.items()},
              "step_ms": {name: 1e3 * sum(o.seconds for o in outs) / sum(o.steps for o in outs)
                          for name, outs in outputs.items()}}
    save(result)
    result["profile"] = {name: profile(decoders[name], prompts[0],
                                       f"{prefix}_profile_{result['dtype']}_{name.replace(' ', '_')}.txt")
                         for name in decoders if name != GENERATE}
    return result


def profile(decode, ids: torch.Tensor, path: str) -> dict:
    """A torch profiler over about PROFILED_STEPS steps of `decode` (after one run off the record): kernels, host and
    device milliseconds per step; its table of kernels to `path`."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    out = decode(ids, PROFILED_STEPS)
    new_tokens = max(1, round(PROFILED_STEPS * out.acceleration_rate))
    decode(ids, new_tokens)
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = decode(ids, new_tokens)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    Path(path).write_text(prof.key_averages().table(sort_by="device_time_total", row_limit=30) + "\n")
    steps = max(out.steps, 1)
    return {"steps": out.steps, "kernels_per_step": len(kernels) / steps,
            "host_ms_per_step": 1e3 * out.seconds / steps,
            "device_ms_per_step": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu", help="PREFIX of PREFIX.json and PREFIX.png")
    parser.add_argument("--small", action="store_true", help="a tiny model in place of the 7B shape (a quick check)")
    parser.add_argument("--nodes", type=int, nargs="+", default=[64], help="tree sizes timed on the 7B shape")
    parser.add_argument("--eager", action="store_true", help="time the 7B shape on the eager engine too")
    parser.add_argument("--questions", type=Path, default=PROMPTS, help="prompts (MT-Bench's format) for SmolLM2")
    parser.add_argument("--turns", type=int, default=TURNS, help="prompts decoded end to end")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="SmolLM2's dtypes")
    parser.add_argument("--no-generate", action="store_true", help="SmolLM2 without transformers' generate")
    parser.add_argument("--parts", nargs="+", default=["smollm2", "7b"], choices=["smollm2", "7b"])
    parser.add_argument("--also", nargs="*", default=[], choices=["sampled", "confident"],
                        help="SmolLM2 decoders beside MEDUSA and plain: sampled, a confident tree")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)

    def save(part: dict | None = None) -> None:
        if part is not None:
            report.setdefault("smollm2", {})[part["dtype"]] = part
        Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")

    for part in args.parts:
        if part == "smollm2":
            for dtype in args.dtypes:
                save(end_to_end(device, getattr(torch, dtype), args.questions, args.turns, args.out, save,
                                not args.no_generate, tuple(args.also)))
                print(smollm2_table(report["smollm2"][dtype]), flush=True)
        else:
            shape = SHAPE_SMALL if args.small else SHAPE_7B
            model, heads = random_llama(shape, device)
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            bandwidth = copy_bandwidth(device)
            engines = ("eager", "compiled") if args.eager else ("compiled",)
            latencies = step_latencies(model, heads, args.nodes, engines)
            del model, heads
            report["llama"] = {"shape": shape, "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bandwidth,
                               "floor_s": weight_bytes / bandwidth, "context": CONTEXT, "nodes": [1, *args.nodes],
                               "step_s": latencies}
            save()
            print(llama_table(report["llama"]), flush=True)
    print(report["device"], f"torch {report['torch']}, transformers {report['transformers']}")
    plot(report, f"{args.out}.png")


def llama_table(llama: dict) -> str:
    floor = llama["floor_s"]
    lines = [f"Llama of {llama['shape']['num_hidden_layers']} layers x {llama['shape']['hidden_size']} (random "
             f"weights), step at a {llama['context']}-token context; bandwidth floor {floor * 1e3:.2f} ms "
             f"({llama['weight_bytes'] / 1e9:.1f} GB at {llama['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s)",
             "| nodes | engine | step (ms) | / floor | / plain |", "| --- | --- | --- | --- | --- |"]
    for engine, seconds in llama["step_s"].items():
        lines += [f"| {nodes} | {engine} | {s * 1e3:.2f} | {s / floor:.2f} | {s / seconds[0]:.2f} |"
                  for nodes, s in zip(llama["nodes"], seconds)]
    return "\n".join(lines)


def smollm2_table(smol: dict) -> str:
    lines = [f"SmolLM2-135M {smol['dtype']}, shipped heads, {smol['tree_nodes']}-node tree, {smol['turns']} turns, "
             f"{NEW_TOKENS} tokens, greedy; MEDUSA lossless: {smol['lossless']}",
             "| decoder | tokens/s | tokens/step | step (ms) |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {speed:.1f} | {smol['tokens_per_step'][name]:.2f} | {smol['step_ms'][name]:.2f} |"
              for name, speed in smol["tokens_per_s"].items()]
    speed = smol["tokens_per_s"]
    versus = f", {speed['medusa'] / speed[GENERATE]:.2f}x static compiled generate" if GENERATE in speed else ""
    lines.append(f"MEDUSA: {speed['medusa'] / speed['plain']:.2f}x plain{versus}; step "
                 f"{smol['step_ms']['medusa'] / smol['step_ms']['plain']:.2f}x plain's")
    lines += [f"profile, {name}: {p['steps']} steps, {p['kernels_per_step']:.0f} kernels, host "
              f"{p['host_ms_per_step']:.2f} ms, device {p['device_ms_per_step']:.2f} ms a step"
              for name, p in smol["profile"].items()]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (steps, speed) = plt.subplots(1, 2, figsize=(11, 4))
    if (llama := report.get("llama")) is not None:
        for engine, seconds in llama["step_s"].items():
            steps.plot(llama["nodes"], [s * 1e3 for s in seconds], marker="o", label=engine)
        steps.axhline(llama["floor_s"] * 1e3, color="gray", linestyle="--", label="bandwidth floor")
        steps.set(xscale="log", xlabel="tree nodes (1: plain)", ylabel="step (ms)",
                  title=f"Llama {llama['shape']['num_hidden_layers']} x {llama['shape']['hidden_size']} step")
        steps.legend()
    runs = report.get("smollm2", {})
    names = list(dict.fromkeys(name for smol in runs.values() for name in smol["tokens_per_s"]))
    for i, (dtype, smol) in enumerate(runs.items()):
        speed.bar([j + 0.4 * i for j in range(len(names))], [smol["tokens_per_s"].get(n, 0) for n in names],
                  width=0.4, label=dtype)
    speed.set_xticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
    speed.set(ylabel="tokens/s", title="SmolLM2-135M end to end")
    speed.legend()
    figure.suptitle(report["device"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
