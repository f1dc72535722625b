"""Where a GPU step's time goes: a turn's fixed cost against its per-step cost, the host's profile,
and the parts of a tree step (attention, top-k, the path move, a layer's linears) timed alone as CUDA graphs, each
beside another way to do it.

usage: python benchmarks/gpu_anatomy.py --questions .gpu2/mt_bench_question.jsonl [--out PREFIX]
Writes PREFIX.json and PREFIX_host_{medusa,plain}_{1,128}.txt (cProfile, by own time). On a GPU only (CUDA graphs).
"""

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

import torch
from gpu import SMOL_CANDIDATES  # (benchmarks/ is the script's path)

from medusa_decoding import GenerationConfig, MedusaModel
from medusa_decoding.bench import read_questions
from medusa_decoding.calibrate import greedy_trees, read_accuracy
from medusa_decoding.embedded import shipped_heads


def graph_us(function, *args, repeats: int = 200) -> float:
    """Microseconds a replay of `function(*args)` (compiled, captured as a CUDA graph) takes."""
    compiled = torch.compile(function, dynamic=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            compiled(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(*args)
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / repeats


def attention_parts(dtype, queries: int, columns: int, heads=9, kv_heads=3, dim=64) -> dict:
    q = torch.randn(1, heads, queries, dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(1, kv_heads, columns, dim, dtype=dtype, device="cuda") for _ in range(2))
    mask = torch.zeros(1, 1, queries, columns, dtype=dtype, device="cuda")
    mask[..., columns // 2:] = torch.finfo(dtype).min
    groups = heads // kv_heads

    def gqa(q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def repeated(q, k, v, mask):
        k, v = (t.repeat_interleave(groups, 1) for t in (k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def folded(q, k, v, mask):  # the query heads of a group as more queries of its kv head
        qf = q.reshape(1, kv_heads, groups * queries, dim)
        scores = (qf @ k.transpose(-1, -2)) * dim ** -0.5 + mask.repeat(1, 1, groups, 1)
        return (scores.float().softmax(-1).to(dtype) @ v).reshape(1, heads, queries, dim)

    def folded_sdpa(q, k, v, mask):
        qf = q.reshape(1, kv_heads, groups * queries, dim)
        out = torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=mask.repeat(1, 1, groups, 1))
        return out.reshape(1, heads, queries, dim)

    return {name: graph_us(f, q, k, v, mask) for name, f in
            (("gqa", gqa), ("repeated", repeated), ("folded", folded), ("folded_sdpa", folded_sdpa))}


def chunked_topk(x: torch.Tensor, k: int, chunk: int = 128) -> torch.Tensor:
    """topk(k).indices over the last dim (a multiple of `chunk`) in two small top-k's: the k chunks of the largest
    maxima hold the k largest (a chunk holding one of them has at most k - 1 chunks of larger maxima), ties aside."""
    blocks = x.unflatten(-1, (-1, chunk))
    best = blocks.amax(-1).topk(k, dim=-1).indices  # [..., k] chunks
    values = blocks.gather(-2, best[..., None].expand(*best.shape, chunk)).flatten(-2)  # [..., k * chunk]
    top = values.topk(k, dim=-1).indices
    return best.gather(-1, top // chunk) * chunk + top % chunk


def other_parts(dtype) -> dict:
    logits = torch.randn(4, 1, 49152, dtype=dtype, device="cuda")
    top = logits.gather(-1, chunked_topk(logits, 10)).sort(-1).values  # the same values (bfloat16 ties: not indices)
    assert torch.equal(top, logits.topk(10).values.sort(-1).values)
    x1, x64 = (torch.randn(n, 576, dtype=dtype, device="cuda") for n in (1, 64))
    q, k, v, gate, up = (torch.randn(n, 576, dtype=dtype, device="cuda") for n in (576, 192, 192, 1536, 1536))
    qkv, gate_up = torch.cat([q, k, v]), torch.cat([gate, up])
    layers = [[torch.randn(1, 3, 2048, 64, dtype=dtype, device="cuda") for _ in range(2)] for _ in range(30)]
    stacked = torch.randn(30, 2, 1, 3, 2048, 64, dtype=dtype, device="cuda")
    lengths = torch.tensor([300], device="cuda")
    paths = torch.tensor([[0, 2, 5, 9, 4]], device="cuda")

    def moves(lengths, paths):
        rows = torch.arange(1, device="cuda")[:, None]
        to, source = lengths[:, None] + torch.arange(5, device="cuda"), lengths[:, None] + paths
        for layer in layers:
            for buffer in layer:
                buffer[rows, :, to] = buffer[rows, :, source]

    def one_move(lengths, paths):
        rows = torch.arange(1, device="cuda")[:, None]
        to, source = lengths[:, None] + torch.arange(5, device="cuda"), lengths[:, None] + paths
        stacked[:, :, rows, :, to] = stacked[:, :, rows, :, source]

    return {"topk10": graph_us(lambda x: x.topk(10, dim=-1).indices, logits),
            "topk10_float": graph_us(lambda x: x.float().topk(10, dim=-1).indices, logits),
            "topk10_chunked": graph_us(lambda x: chunked_topk(x, 10), logits),
            "argmax": graph_us(lambda x: x.argmax(-1), logits),
            # a layer's linears but o and down, as SmolLM2 runs them (5) and with q, k, v and gate, up fused (2)
            **{f"linears_{name}_{len(x)}": graph_us(f, x) for x in (x1, x64) for name, f in (
                ("separate", lambda x: [x @ w.T for w in (q, k, v, gate, up)]),
                ("fused", lambda x: [x @ qkv.T, x @ gate_up.T]))},
            "moves_60": graph_us(moves, lengths, paths), "moves_1": graph_us(one_move, lengths, paths)}


def turns(medusa: MedusaModel, prompts: list, out: str) -> dict:
    """Per decoder: seconds of a 1-token generate (the turn's fixed cost) and of a 128-token one, and their steps;
    cProfile of the host over both."""
    result = {}
    for name, config in (("medusa", GenerationConfig()), ("plain", GenerationConfig(medusa=False))):
        for ids in prompts:  # warm-up: every window these turns reach
            medusa.generate(ids, config=config, max_new_tokens=128)
        rows = []
        for n in (1, 128):
            outs = [medusa.generate(ids, config=config, max_new_tokens=n) for ids in prompts]
            rows.append((sum(o.seconds for o in outs) / len(outs), sum(o.steps for o in outs) / len(outs)))
        (fixed, _), (whole, steps) = rows
        result[name] = {"one_token_s": fixed, "turn_s": whole, "steps": steps,
                        "per_step_ms": 1e3 * (whole - fixed) / (steps - 1)}
        for n in (1, 128):
            profiler = cProfile.Profile()
            profiler.enable()
            for ids in prompts:
                medusa.generate(ids, config=config, max_new_tokens=n)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
            Path(f"{out}_host_{name}_{n}.txt").write_text(text.getvalue())
        print(name, result[name], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=Path, required=True)
    parser.add_argument("--out", default="benchmarks/results/gpu_anatomy", help="PREFIX of the files written")
    args = parser.parse_args()
    report = {}
    for dtype in (torch.bfloat16,):
        parts = {f"attention_{t}x{s}": attention_parts(dtype, t, s) for t in (1, 64) for s in (256, 512, 1024, 2048)}
        parts.update(other_parts(dtype))
        report["parts_us"] = parts
        print(json.dumps(parts, indent=1), flush=True)
    heads_dir = shipped_heads()
    tree = greedy_trees(read_accuracy(heads_dir).accuracy, [SMOL_CANDIDATES])[0]
    medusa = MedusaModel.from_pretrained(heads=heads_dir, tree=tree, device="cuda", dtype=torch.bfloat16,
                                         engine="compiled")
    chosen = read_questions([args.questions], per_category=1)[:6]
    prompts = [medusa.encode(messages=[{"role": "user", "content": q.turns[0]}]) for q in chosen]
    report["turns"] = turns(medusa, prompts, args.out)
    Path(f"{args.out}.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
