"""`medusa bench --concurrency`: a load test of the server, over real HTTP.

N clients on loopback, each sending its next streamed chat request as soon as its last one ends, against one
`medusa serve` app in this process, in three modes: MEDUSA with continuous batching, plain steps with continuous
batching (the request's `medusa.tree` []), and MEDUSA one request at a time (max_batch 1: the server before
batching). Bounded in count (requests per client) and time (no request starts after `seconds`; each has a timeout).
Reports aggregate tokens/s, time to first token and per-request latency (p50, p99), errors, and whether every answer
is the very text its prompt gets alone: greedy decoding is batch-invariant, so any difference is a lost or mixed
answer.
"""

import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx

from .config import GenerationConfig
from .scheduler import Scheduler
from .server import create_app, serving

MODES = ("medusa", "plain", "one-at-a-time")  # batched MEDUSA, batched plain steps, MEDUSA one request at a time
MODEL_ID = "load-test"
REQUEST_TIMEOUT_S = 600


@dataclass
class Result:
    """One request as its client saw it."""

    prompt: int  # index into the prompts
    text: str = ""
    tokens: int = 0
    first_token_s: float = 0.0
    seconds: float = 0.0
    error: str = ""


def request(url: str, prompt: str, config: GenerationConfig, plain: bool) -> tuple[str, int, float]:
    """One streamed chat completion -> (text, completion tokens, seconds to the first text)."""
    options = {"medusa": {"tree": [], "lookup": 0, "corpus": 0}} if plain else {}  # plain: no candidates at all
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": config.max_new_tokens,
            "temperature": config.temperature, "stream": True, **options}
    start, first, text, tokens = time.perf_counter(), 0.0, "", 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if piece := event["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter() - start
                text += piece
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return text, tokens, first


def run(url: str, prompts: list[str], clients: int, per_client: int, config: GenerationConfig, plain: bool,
        seconds: float) -> tuple[list[Result], float]:
    """`clients` clients, `per_client` requests each (fewer if `seconds` run out) -> (results, wall seconds)."""
    start, lock, queue = time.perf_counter(), threading.Lock(), list(range(clients * per_client))[::-1]

    def client() -> list[Result]:
        results = []
        while time.perf_counter() - start < seconds:
            with lock:
                if not queue:
                    break
                number = queue.pop()
            result, sent = Result(number % len(prompts)), time.perf_counter()
            try:
                result.text, result.tokens, result.first_token_s = request(url, prompts[result.prompt], config, plain)
            except Exception as error:  # counted and reported; the load goes on
                result.error = str(error)
            result.seconds = time.perf_counter() - sent
            results.append(result)
        return results

    with ThreadPoolExecutor(clients) as pool:
        done = [r for results in pool.map(lambda _: client(), range(clients)) for r in results]
    return done, time.perf_counter() - start


def counters(scheduler: Scheduler) -> tuple[int, int, int]:
    """The scheduler's forward passes, rows stepped and candidates verified so far (what its trees were)."""
    return scheduler.forward_passes, scheduler.row_steps, scheduler.candidates


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values or [0.0])[0]


def summarize(results: list[Result], wall: float) -> dict:
    ok = [r for r in results if not r.error]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "tokens": sum(r.tokens for r in ok),
        "tokens_per_s": sum(r.tokens for r in ok) / wall,
        "first_token_s": {"p50": percentile([r.first_token_s for r in ok], 50),
                          "p99": percentile([r.first_token_s for r in ok], 99)},
        "latency_s": {"p50": percentile([r.seconds for r in ok], 50), "p99": percentile([r.seconds for r in ok], 99)},
        "seconds": wall,
    }


def load_benchmark(load_model, prompts: list[str], concurrency: tuple[int, ...], per_client: int,
                   config: GenerationConfig, seconds: float, progress: bool = True, repeat: int = 1) -> dict:
    """Every concurrency in every mode on one server (one Scheduler thread: the model is loaded on it, as `medusa serve`
    does). Answers are checked against the first one-request-at-a-time answer to each prompt. repeat: the modes run
    this many times in turn and the fastest run of each counts (a shared machine's noise only slows a run), with the
    errors and wrong answers of every run."""
    if config.temperature != 0:
        raise ValueError("the load benchmark checks answers against each other: greedy only (temperature 0)")
    if not concurrency or min(concurrency) < 1 or per_client < 1 or repeat < 1:
        raise ValueError(f"concurrency, requests per client and repeats must be positive, got {concurrency}, "
                         f"{per_client} and {repeat}")
    scheduler = Scheduler(max_batch=max(concurrency), max_queue=max(concurrency))
    medusa = scheduler.load(load_model)
    rows, answers = [], {}
    with serving(create_app(medusa, MODEL_ID, scheduler)) as url:
        request(url, prompts[0], GenerationConfig(max_new_tokens=8), plain=False)  # warm-up, not timed
        for clients in concurrency:
            best: dict[str, dict] = {}
            for _ in range(repeat):
                for mode in ("one-at-a-time", "plain", "medusa"):  # the reference answers first
                    row = measure(url, scheduler, prompts, clients, mode, per_client, config, seconds, answers)
                    if progress:
                        print(line(row), flush=True)
                    kept = best.get(mode, {"tokens_per_s": -1.0, "errors": 0, "wrong_answers": 0, "runs": 0})
                    fastest = row if row["tokens_per_s"] > kept["tokens_per_s"] else kept
                    best[mode] = {**fastest, "runs": kept["runs"] + 1, "errors": kept["errors"] + row["errors"],
                                  "wrong_answers": kept["wrong_answers"] + row["wrong_answers"]}
            rows += best.values()
    for row in rows:
        alone = next(r for r in rows if r["clients"] == row["clients"] and r["mode"] == "one-at-a-time")
        row["speedup_vs_one_at_a_time"] = row["tokens_per_s"] / alone["tokens_per_s"] if alone["tokens_per_s"] else 0.0
    return {"config": {**asdict(config), "concurrency": list(concurrency), "requests_per_client": per_client,
                       "seconds": seconds, "prompts": len(prompts), "repeat": repeat}, "rows": rows}


def measure(url: str, scheduler: Scheduler, prompts: list[str], clients: int, mode: str, per_client: int,
            config: GenerationConfig, seconds: float, answers: dict[int, str]) -> dict:
    """One run of `clients` clients in `mode` -> its row; answers: each prompt's first answer, which every later one
    must equal (a prompt answered for the first time sets it)."""
    scheduler.max_batch = 1 if mode == "one-at-a-time" else clients
    before = counters(scheduler)
    results, wall = run(url, prompts, clients, per_client, config, mode == "plain", seconds)
    passes, row_steps, candidates = (b - a for a, b in zip(before, counters(scheduler)))
    ok = [r for r in results if not r.error]
    mixed = sum(answers.setdefault(r.prompt, r.text) != r.text for r in ok)
    steps = passes - len(ok)  # less the prefills
    return {"clients": clients, "mode": mode, **summarize(results, wall), "wrong_answers": mixed,
            "mean_batch": row_steps / max(steps, 1), "mean_candidates": candidates / max(row_steps, 1)}


def line(row: dict) -> str:
    return (f"{row['clients']:>7} {row['mode']:<14} {row['tokens_per_s']:>8.1f} {row['first_token_s']['p50']:>7.2f} "
            f"{row['first_token_s']['p99']:>7.2f} {row['latency_s']['p50']:>7.2f} {row['latency_s']['p99']:>7.2f} "
            f"{row['requests']:>5} {row['errors']:>4} {row['wrong_answers']:>5} {row['mean_batch']:>6.1f} "
            f"{row['mean_candidates']:>6.2f}")


HEADER = (f"{'clients':>7} {'mode':<14} {'tok/s':>8} {'ttft50':>7} {'ttft99':>7} {'lat50':>7} {'lat99':>7} "
          f"{'reqs':>5} {'err':>4} {'wrong':>5} {'batch':>6} {'cands':>6}")


def table(report: dict) -> str:
    rows = [HEADER] + [line(row) + f"  {row['speedup_vs_one_at_a_time']:.2f}x" for row in report["rows"]]
    return "\n".join(rows) + ("\n(ttft: time to first token, lat: request latency, seconds; batch: rows per step; "
                             "cands: candidates a row verified per step, the trees the guards chose; x: tokens/s "
                             "against one request at a time with the same clients)")


def plot(report: dict, path) -> None:
    """Aggregate tokens/s and p50 latency against the number of clients, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, latency) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in MODES:
        rows = [r for r in report["rows"] if r["mode"] == mode]
        clients = [r["clients"] for r in rows]
        speed.plot(clients, [r["tokens_per_s"] for r in rows], marker="o", label=mode)
        latency.plot(clients, [r["latency_s"]["p50"] for r in rows], marker="o", label=mode)
    for axes, label in ((speed, "aggregate new tokens / s"), (latency, "request latency p50 (s)")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(report["config"]["concurrency"], [str(n) for n in report["config"]["concurrency"]])
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel(label)
        axes.set_ylim(bottom=0)
        axes.legend()
    speed.set_title(f"throughput ({report['config']['max_new_tokens']} tokens per answer, greedy)")
    latency.set_title("latency")
    figure.suptitle(report.get("device", ""), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
