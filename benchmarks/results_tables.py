"""The tables made from benchmarks/results/*.json: README.md's results section (a table per machine kind),
MODEL_CARD.md's results per model, and benchmarks/results/README.md's index (every JSON file: its date, machine,
model, what it measures and its headline figure).

    python benchmarks/results_tables.py            # rewrite all three
    python benchmarks/results_tables.py --check    # write nothing; exit 1, naming the files, where one is stale

Only what lies between markers is written: README.md's `<!-- results:begin -->` ... `<!-- results:end -->`,
MODEL_CARD.md's `<!-- results:MODEL:begin -->` ... `<!-- results:MODEL:end -->` (that model's rows), and everything
below `<!-- index -->` in the results README (the hand-written header above it stays). The output depends only on
the JSON files and on git's history of them, so it is the same on every run.

Which results the README and the card show: for each machine, benchmark (question files and answer length), model and
build, the newest file's row. Only runs with the heads shipped at the time (no --heads, or the package's own) and only
machines a user can compare with (a GPU, or a CPU the file names by family and model) count; every file is in the
index. Between files of one commit the one with the most turns wins, then the shortest name (a variant's name adds to
its base run's: _again, _same_fit, _sweep). A cost curve gives, per model and build, its fastest kernels' plain step.

Where the figures come from:
- a file's date: a `date` field in the file where it has one, else the last commit that changed the file (git), else
  "not committed"; an uncommitted file counts as the newest. Commit a new result, then run this script.
- the machine: the file's `device` (or `setup`), its CPU named by family and model (and by the core's name where the
  project's notes name it, ARCHITECTURES), with its threads. The GGUF cost curves record no device: MACHINES holds
  what their notes say.
- what the file name says that the file does not: `avx2` (the AVX2 build forced on an AVX-512 CPU, MEDUSA_ISA=avx2)
  and `fp32` (float32 on a GPU) mark the build.
Shapes read: `medusa bench` reports (an `overall` with tokens/s), serving load tests, benchmarks/gpu.py's reports,
the GGUF cost curves (a list of rows with plain_ms and llama_cpp_ms), and the smaller measurements of the other
scripts (kernels, attention, probes, calibration, fidelity, held-out accuracy); a file of any other shape, or one
that is not JSON, is listed in the index as not read.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
CARD = ROOT / "MODEL_CARD.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
CARD_MARKER = re.compile(r"<!-- results:(?P<model>[^>]+?):begin -->")  # MODEL_CARD.md: a model's own rows
INDEX = "<!-- index -->"

# (vendor, family, model) -> the core's name, where the project's own notes name it
ARCHITECTURES = {("AMD", 25, 1): "Zen 3", ("AMD", 25, 17): "Zen 4", ("AMD", 26, 2): "Zen 5",
                 ("Intel", 6, 106): "Ice Lake"}
# cores without AVX-512: the AVX2 build is their own, not a forced one
AVX2_ONLY = {"Zen 3"}
# files that do not record their machine, and the machine their notes in results_log.md name
MACHINES = {
    "gguf_cost_curve.json": "Intel(R) Xeon(R) Processor (family 6, model 106), 2 threads",
    "gguf_cost_curve_compiled.json": "Intel(R) Xeon(R) Processor (family 6, model 106), 2 threads",
    "gguf_cost_curve_gemma3.json": "Intel(R) Xeon(R) Processor (family 6, model 106), 2 threads",
}
QUESTIONS = {"mt_bench_question.jsonl": "MT-Bench", "spec_bench_dev.jsonl": "Spec-Bench dev",
             "held_out.jsonl": "held-out prompts"}
MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M", "gemma-3-270m": "Gemma 3 270M",
          "1b": "Llama-3.2-1B shape", "3b": "Llama-3.2-3B shape", "8b": "Llama-3.1-8B shape", "llama": "Llama 7B shape"}
MISSING = "—"
COLUMNS = ("MEDUSA tok/s", "plain tok/s", "llama.cpp tok/s", "MEDUSA / plain", "tokens/step", "lossless", "file")


@dataclass
class Row:
    """One line of a machine's table in README.md."""

    machine: str
    benchmark: str
    model: str
    engine: str
    medusa: float | None = None
    plain: float | None = None
    llama_cpp: float | None = None
    speedup: float | None = None
    tokens_per_step: float | None = None
    lossless: bool | None = None
    key: tuple = ()  # machine, benchmark, model and build: the rows of which the newest is shown
    turns: int = 0  # between files of one commit, the one with more turns is the run (fewer: a sweep, a check)


@dataclass
class Entry:
    """One JSON file: a line of the index and the rows it gives README.md."""

    name: str
    machine: str = MISSING
    model: str = MISSING
    what: str = MISSING
    headline: str = MISSING
    rows: list[Row] = field(default_factory=list)
    date: str = "not committed"
    order: tuple = (1, 0)  # sorts by age: (0, commit time) committed, (1, 0) not committed (the newest)


# ---- reading ---------------------------------------------------------------------------------------------------


def git_dates(folder: Path) -> dict[str, tuple[int, str]]:
    """file name -> (commit time, date) of the last commit that changed it; {} outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "log", "--relative", "--format=%x00%ct %cs", "--name-only",
                              "--", "."], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    dates: dict[str, tuple[int, str]] = {}
    for commit in out.split("\0")[1:]:
        head, _, names = commit.partition("\n")
        stamp, day = head.split()
        for name in filter(None, names.splitlines()):
            dates.setdefault(name, (int(stamp), day))  # newest first: the first seen is the last change
    return dates


def machine_name(device: object) -> tuple[str, bool]:
    """A device string as a machine kind, and whether it names one (a GPU, or a CPU with family and model)."""
    if not isinstance(device, str) or not device.strip():
        return MISSING, False
    text = device.replace("(R)", "").replace(" Processor", "").strip()
    threads = re.search(r",\s*(\d+) threads?\b", text)
    if threads:
        text = text[:threads.start()]  # what follows the threads is the run's setup, not the machine
    text = re.sub(r"\s*@\s*[\d.]+GHz", "", text)
    found = re.search(r"\(family (\d+), model (\d+)\)", text)
    if found:
        vendor = "AMD" if "AMD" in text else "Intel" if "Intel" in text else ""
        core = ARCHITECTURES.get((vendor, int(found.group(1)), int(found.group(2))))
        if core:
            text = f"{text[:found.start()].rstrip()} {core} {text[found.start():]}"
    cpu = any(word in text for word in ("AMD", "Intel", "Xeon", "EPYC"))
    if threads:
        text += f", {threads.group(1)} thread{'s' if threads.group(1) != '1' else ''}"
    return " ".join(text.split()), bool(found) or not cpu


def model_name(value: object) -> str:
    if not isinstance(value, str) or not value:
        return MISSING
    value = value.rstrip("/").rsplit("/", 1)[-1]
    return MODELS.get(value, value)


def questions(config: dict) -> str:
    files = config.get("questions") or []
    files = [files] if isinstance(files, str) else files
    names = [QUESTIONS.get(Path(f).name, Path(f).stem) for f in files]
    return " + ".join(names) or "questions not recorded"


def variant(name: str, machine: str) -> str:
    """What the file name says about the engine that the file does not."""
    words = set(re.split(r"[_.]", name))
    if "avx2" in words and not any(core in machine for core in AVX2_ONLY):
        return ", AVX2 build"
    return ", float32" if "fp32" in words else ""


def setup(record: dict) -> str:
    """The kernels a run's record names, and the compiled engine where it ran on it (records from before the engine
    was a setting of its own name it in their kernels: compiled, compiled-q8)."""
    engine = ", compiled engine" if record.get("engine") == "compiled" else ""
    return (record.get("kernels") or "default kernels") + engine


def number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def shipped(config: dict) -> bool:
    """Whether a run decoded with the heads shipped at the time (trained; none given, or the package's own)."""
    heads = config.get("heads")
    return config.get("heads_trained") is not False and (not heads or "src/medusa_decoding/assets/" in heads)


def bench_report(entry: Entry, data: dict, machine: str, named: bool) -> None:
    """`medusa bench`'s JSON: a row per file, the headline from `overall`."""
    config, overall = data.get("config") or {}, data["overall"]
    speeds = overall["tokens_per_s"]
    entry.model = model_name(config.get("model"))
    kind = f"{config['kind']} heads" if config.get("kind") else "heads"
    given = config.get("heads")
    heads = (f"shipped {kind}" if shipped(config) else "untrained heads" if config.get("heads_trained") is False
             else f"{kind} from {Path(given).name}")
    build = variant(entry.name, machine)
    engine = setup(config) + build
    turns, tokens = overall.get("turns"), config.get("max_new_tokens")
    benchmark = f"{questions(config)}, {turns} turns, {tokens} tokens"
    entry.what = f"`medusa bench`: {benchmark}; {heads}, {engine}"
    rivals = [r for r in (overall.get("rivals") or {}) if not r.startswith("medusa, no ")]
    if rivals:
        entry.what += "; rivals: " + ", ".join(rivals)
    medusa, plain = number(speeds.get("medusa")), number(speeds.get("plain"))
    parts = [f"MEDUSA {medusa:.1f} tok/s" if medusa else None,
             f"{overall['speedup']:.2f}x plain" if number(overall.get("speedup")) else None,
             f"{overall['acceleration_rate']:.2f} tokens/step" if number(overall.get("acceleration_rate")) else None,
             f"{overall['speedup_vs_llama_cpp']:.2f}x llama.cpp" if number(overall.get("speedup_vs_llama_cpp"))
             else None,
             {True: "lossless", False: "not lossless"}.get(data.get("lossless"))]
    entry.headline = ", ".join(p for p in parts if p) or MISSING
    if named and shipped(config) and config.get("questions") and medusa and plain:
        entry.rows.append(Row(machine, f"{questions(config)}, {tokens} tokens ({turns} turns)", entry.model,
                              engine, medusa, plain, number(speeds.get("llama.cpp")), number(overall.get("speedup")),
                              number(overall.get("acceleration_rate")), data.get("lossless"),
                              key=(machine, questions(config), tokens, entry.model, build), turns=turns or 0))


def serving(entry: Entry, data: dict) -> None:
    config = data.get("config") or {}
    entry.model = model_name(config.get("model"))
    rows = [r for r in data["rows"] if isinstance(r, dict)]
    clients = sorted({r.get("clients") for r in rows if isinstance(r.get("clients"), int)})
    entry.what = f"`medusa serve` under load (loadtest): {', '.join(map(str, clients))} clients, " \
                 f"{config.get('max_new_tokens')} tokens a request"
    medusa = [r for r in rows if r.get("mode") == "medusa" and r.get("clients") == clients[-1]] if clients else []
    if medusa and number(medusa[0].get("tokens_per_s")):
        best = medusa[0]
        entry.headline = (f"{best['clients']} clients: MEDUSA batched {best['tokens_per_s']:.1f} tok/s, "
                          f"{best.get('speedup_vs_one_at_a_time', 0):.2f}x one request at a time")


def gpu_report(entry: Entry, data: dict, machine: str, named: bool) -> None:
    """benchmarks/gpu.py: per model, per dtype the compiled engine's MEDUSA and plain decoding; a 7B shape's step."""
    entry.what = "`benchmarks/gpu.py`: MT-Bench first turns on the compiled engine; a 7B-shaped Llama's step"
    heads, models = [], []
    for key, value in data.items():
        if not isinstance(value, dict) or key in ("device",):
            continue
        if "step_s" in value:  # the 7B shape: step times, no tokens
            models.append(MODELS.get(key, key))
            steps = value["step_s"]
            for engine, times in steps.items():
                nodes = value.get("nodes") or []
                pairs = ", ".join(f"{n} node{'s' if n != 1 else ''} {t * 1000:.1f} ms" for n, t in zip(nodes, times))
                heads.append(f"{MODELS.get(key, key)} step ({engine}): {pairs}"
                             + (f"; floor {value['floor_s'] * 1000:.1f} ms" if number(value.get("floor_s")) else ""))
            continue
        for dtype, run in value.items():
            if not isinstance(run, dict) or "tokens_per_s" not in run:
                continue
            models.append(model_name(key))
            medusa, plain = number(run["tokens_per_s"].get("medusa")), number(run["tokens_per_s"].get("plain"))
            steps = number((run.get("tokens_per_step") or {}).get("medusa"))
            if not (medusa and plain):
                continue
            heads.append(f"{dtype}: MEDUSA {medusa:.1f} tok/s, {medusa / plain:.2f}x plain"
                         + (f", {steps:.2f} tokens/step" if steps else ""))
            if named:
                turns = run.get("turns")
                entry.rows.append(Row(machine, f"MT-Bench first turns ({turns} turns, gpu.py)", model_name(key),
                                      f"compiled, {dtype}", medusa, plain, None, medusa / plain, steps,
                                      run.get("lossless"), key=(machine, "gpu.py", model_name(key), dtype),
                                      turns=turns if isinstance(turns, int) else 0))
    entry.model = ", ".join(dict.fromkeys(models)) or MISSING
    entry.headline = "; ".join(heads) or MISSING


def cost_curve(entry: Entry, rows: list, machine: str, named: bool) -> None:
    """gguf_cost_curve.py: our plain step against llama.cpp's on the same GGUF file, per model, ISA and kernels."""
    entry.what = "`benchmarks/gguf_cost_curve.py`: one plain step against llama.cpp's on the same GGUF file, " \
                 "and a tree's cost by candidates"
    models, first, fastest = [], {}, {}
    for row in rows:
        model = MODELS.get(row.get("model"), row.get("model"))
        models.append(model)
        first.setdefault(model, row)
        plain, llama = number(row.get("plain_ms")), number(row.get("llama_cpp_ms"))
        if not (named and plain and llama):
            continue
        build = ", AVX2 build" if row.get("isa") == "avx2" and not any(c in machine for c in AVX2_ONLY) else ""
        line = Row(machine, f"one plain step, {row.get('context')}-token context (cost curve)", model,
                   f"{setup(row)}{build}", None, 1000 / plain, 1000 / llama,
                   key=(machine, "cost curve", model, build))
        if line.key not in fastest or line.plain > fastest[line.key].plain:  # of a file's kernels, the fastest
            fastest[line.key] = line
    entry.rows += fastest.values()
    entry.model = ", ".join(dict.fromkeys(models)) or MISSING
    entry.headline = "plain step against llama.cpp's: " + ", ".join(
        f"{model} {row['plain_vs_llama_cpp']:.2f}x ({setup(row)}, {row.get('isa')})"
        for model, row in first.items() if number(row.get("plain_vs_llama_cpp")))


def top1(report: dict) -> list[tuple[str, float]]:
    return [(name, value["top1"][0]) for name, value in report.items()
            if isinstance(value, dict) and isinstance(value.get("top1"), list) and value["top1"]]


def smaller(entry: Entry, data: dict) -> bool:
    """The other scripts' measurements: what each measures and its headline. False: a shape not known here."""
    keys = set(data)
    if {"step_latency_s", "greedy_agreement_with_stock"} <= keys:
        entry.what = "`benchmarks/cpu_kernels.py`: a step's latency per kernel and tokens a pass"
        entry.headline = "one-token step: " + ", ".join(
            f"{k} {v[0] * 1000:.1f} ms" for k, v in data["step_latency_s"].items() if v)
    elif {"median_ms", "ratio_to_one_token"} <= keys:
        entry.what = f"`benchmarks/q8_linears.py`: {data.get('linears')} q8 linears over 1-16 tokens, per path"
        entry.headline = "over 1 token: " + ", ".join(f"{k} {v[0]:.1f} ms" for k, v in data["median_ms"].items() if v)
    elif {"median_ms", "contexts", "layers"} <= keys:
        entry.what = "`benchmarks/attention.py`: the native attention over 1-16 tokens, per variant and context"
        entry.headline = "1 / 16 tokens: " + ", ".join(
            f"{k} {v[0]:.2f} / {v[-1]:.2f} ms" for k, v in data["median_ms"].items() if v)
    elif "ratio_large_to_small" in keys:
        entry.what = "`benchmarks/large_pages.py`: a q8 step with the weights in 2 MB pages against 4 KB"
        steps, ratios = data.get("steps") or [], data["ratio_large_to_small"]
        entry.headline = "2 MB / 4 KB pages: " + ", ".join(f"{s} {r:.2f}x" for s, r in zip(steps, ratios))
    elif "parts_us" in keys:
        entry.what = "`benchmarks/gpu_anatomy.py`: a GPU step's parts, and a turn's steps"
        turns = data.get("turns") or {}
        entry.headline = ", ".join(f"{k} {v['per_step_ms']:.2f} ms a step" for k, v in turns.items()
                                   if number((v or {}).get("per_step_ms"))) or MISSING
    elif "variants" in keys and "heldout_positions" in keys:
        probe = ("a decoder layer over the prefix" if "ceiling_base_argmax" in keys
                 else "regressing the next hidden state" if "regress" in keys else "earlier layers' features")
        entry.what = f"head 0 trained further on cached features, variants ({probe}): held-out top-1 per epoch"
        entry.headline = "head 0 top-1 at the end: " + ", ".join(
            f"{k} {v['heldout_top1'][-1]:.3f}" for k, v in data["variants"].items() if v.get("heldout_top1"))
    elif {"accuracy", "paths", "sizes", "expected_tokens"} <= keys:
        entry.what = "`medusa calibrate`: each head's accuracy by rank, the step's latency, the tree chosen"
        size = data.get("size")
        expected = (data["expected_tokens"][data["sizes"].index(size)]
                    if size in data["sizes"] and len(data["expected_tokens"]) == len(data["sizes"]) else None)
        entry.headline = (f"head 0 rank-0 accuracy {data['accuracy'][0][0]:.3f}; {size} candidates chosen"
                          + (f", {expected:.2f} tokens/step expected" if expected else ""))
    elif "top1_agreement" in keys:
        entry.what = "`benchmarks/q8_fidelity.py`: how far q8's 8-bit activations move the model from native"
        greedy = data.get("greedy") or {}
        kl = data.get("mean_kl_native_to_q8")
        entry.headline = f"top-1 agreement {data['top1_agreement']:.1%}" + (f", mean KL {kl:.4f}" if number(kl) else "")
        if "turns" in greedy:
            entry.headline += f"; greedy identical {greedy['identical']} / {greedy['turns']}"
    elif "greedy_identical_rate" in keys:
        entry.what = "`benchmarks/medusa2_fidelity.py`: how far MEDUSA-2's tuned backbone moves the model's answers"
        entry.headline = (f"greedy answers identical to the original's {data['greedy_identical_rate']:.0%} of "
                          f"{data.get('questions')}; {data.get('acceleration_rate', 0):.2f} tokens/step")
    elif {"identical", "turns", "dtype"} <= keys:
        entry.what = f"`benchmarks/bf16_lossless.py`: greedy MEDUSA against plain decoding in {data['dtype']}"
        entry.headline = f"{data['identical']} of {data['turns']} answers identical"
    elif "id_threshold_16384" in keys:
        entry.what = "`benchmarks/guess_vocab_coverage.py`: held-out answer tokens inside each guess vocabulary"
        entry.model = model_name(data.get("model"))
        entry.headline = ", ".join(f"{r['vocabulary']}{' + own tokens' if r.get('own_tokens') else ''} "
                                   f"{r['coverage']:.1%}" for r in data["rows"][:2])
    elif "conversations_indexed" in keys:
        entry.what = "`benchmarks/corpus_min_seen.py`: corpus index size against tokens a step, by min_seen"
        entry.headline = ", ".join(f"min_seen {r['min_seen'] or 'none'}: {r['tokens_per_step']:.2f} tokens/step "
                                   f"({r['megabytes']:.1f} MB)" for r in data["rows"])
    elif "per_category" in keys and "categories" in keys and "model" in keys:
        entry.what = "`benchmarks/lookup_ceiling.py`: the most lookup drafts could give, per category"
        entry.model = model_name(data.get("model"))
        entry.headline = "speedup ceiling: " + ", ".join(
            f"{k} {v['speedup_ceiling']:.2f}x" for k, v in data["categories"].items()
            if number((v or {}).get("speedup_ceiling")))
    elif "results" in keys and "guess_vocab" in keys:
        entry.what = "heads trained towards the data's tokens or the teacher's: calibration accuracy"
        entry.headline = "head 0 top-1: " + ", ".join(f"{k} {v:.3f}" for k, v in top1(data["results"]))
    elif top1(data) and all(isinstance(v, dict) for v in data.values()):
        entry.what = "`benchmarks/heads_heldout.py`: each set of heads' top-1 on the model's own answers"
        entry.headline = "head 0 top-1: " + ", ".join(f"{k} {v:.3f}" for k, v in top1(data))
    else:
        return False
    return True


def read(path: Path, dates: dict[str, tuple[int, str]]) -> Entry:
    entry = Entry(path.name)
    if path.name in dates:
        stamp, entry.date = dates[path.name]
        entry.order = (0, stamp)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        entry.what = f"not read: {type(error).__name__}"
        return entry
    day = data.get("date") if isinstance(data, dict) else None
    if isinstance(day, str) and re.match(r"\d{4}-\d{2}-\d{2}", day):  # the file's own date comes first
        entry.date = day[:10]
        entry.order = (0, int(datetime.fromisoformat(entry.date).replace(tzinfo=timezone.utc).timestamp()))
    try:
        if isinstance(data, list) and data and all(isinstance(r, dict) and "plain_ms" in r for r in data):
            machine, named = machine_name(data[0].get("device") or MACHINES.get(path.name))
            entry.machine = machine
            cost_curve(entry, data, machine, named)
        elif isinstance(data, dict):
            machine, named = machine_name(data.get("device") or data.get("setup"))
            entry.machine = machine
            overall = data.get("overall")
            if isinstance(overall, dict) and isinstance(overall.get("tokens_per_s"), dict):
                bench_report(entry, data, machine, named)
            elif isinstance(data.get("rows"), list) and "concurrency" in (data.get("config") or {}):
                serving(entry, data)
            elif any(isinstance(v, dict) and (any(isinstance(r, dict) and "tokens_per_s" in r for r in v.values())
                                              or "step_s" in v) for v in data.values()):
                gpu_report(entry, data, machine, named)
            elif not smaller(entry, data):
                entry.what = "not read: a shape this script does not know (keys: " + ", ".join(sorted(data)[:6]) + ")"
        else:
            entry.what = "not read: a shape this script does not know"
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError) as error:
        entry.rows, entry.headline = [], MISSING
        entry.what = f"not read: {type(error).__name__} {error}"
    return entry


def entries(folder: Path) -> list[Entry]:
    dates = git_dates(folder)
    return [read(path, dates) for path in sorted(folder.glob("*.json"))]


# ---- writing ---------------------------------------------------------------------------------------------------


def cell(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return MISSING if value is None else f"{value:.{digits}f}{suffix}"


def link(name: str, folder: Path, base: Path) -> str:
    return f"[{name}]({Path(os.path.relpath(folder / name, base)).as_posix()})"


def made_by(folder: Path, base: Path) -> str:
    where = Path(os.path.relpath(folder, base)).as_posix()
    return f"<!-- made by benchmarks/results_tables.py from {where}/*.json: edit them or the script, not this -->"


def table(first: tuple[str, ...], rows: list[tuple[Row, Entry]], folder: Path, base: Path,
          cells=lambda row: (row.benchmark, row.model, row.engine)) -> list[str]:
    """A markdown table of rows: the given first columns, then COLUMNS."""
    lines = ["| " + " | ".join((*first, *COLUMNS)) + " |",
             "| " + " | ".join(["---"] * len(first) + ["---:"] * 5 + ["---"] * 2) + " |"]
    for row, entry in rows:
        lossless = {True: "yes", False: "no"}.get(row.lossless, MISSING)
        values = (*cells(row), cell(row.medusa), cell(row.plain), cell(row.llama_cpp), cell(row.speedup, 2, "x"),
                  cell(row.tokens_per_step, 2), lossless, f"{link(entry.name, folder, base)} ({entry.date})")
        lines.append("| " + " | ".join(values) + " |")
    return lines


def current(found: list[Entry]) -> list[tuple[Row, Entry]]:
    """The newest row of each machine, benchmark, model and build. Between files of one commit: the one with the
    most turns, then the shortest name (a variant's name adds to its base run's: _again, _same_fit, _sweep)."""
    newest: dict[tuple, tuple[Row, Entry]] = {}
    rank = lambda row, entry: (entry.order, row.turns, -len(entry.name), entry.name)
    for entry in found:
        for row in entry.rows:
            if row.key not in newest or rank(row, entry) > rank(*newest[row.key]):
                newest[row.key] = (row, entry)
    return list(newest.values())


def results_section(found: list[Entry], folder: Path, base: Path) -> str:
    """README.md's results: one table per machine kind, CPUs first."""
    by_machine: dict[str, list[tuple[Row, Entry]]] = {}
    for row, entry in current(found):
        by_machine.setdefault(row.machine, []).append((row, entry))
    lines = [made_by(folder, base)]
    gpu = lambda name: not any(word in name for word in ("AMD", "Intel", "Xeon", "EPYC"))
    for machine in sorted(by_machine, key=lambda m: (gpu(m), m)):
        rows = sorted(by_machine[machine], key=lambda p: (p[0].benchmark, p[0].model, p[0].engine))
        lines += ["", f"#### {machine}", *table(("benchmark", "model", "engine"), rows, folder, base)]
    return "\n".join(lines) + "\n"


def model_section(found: list[Entry], model: str, folder: Path, base: Path) -> str:
    """A model card's results: the README's rows of that model, every machine in one table."""
    rows = sorted(((r, e) for r, e in current(found) if r.model == model),
                  key=lambda p: (p[0].machine, p[0].benchmark, p[0].engine))
    lines = [made_by(folder, base), ""]
    if not rows:
        return "\n".join(lines + ["No result file measures this model yet."]) + "\n"
    lines += table(("machine", "benchmark", "engine"), rows, folder, base,
                   cells=lambda row: (row.machine, row.benchmark, row.engine))
    return "\n".join(lines) + "\n"


def card_sections(text: str, found: list[Entry], folder: Path, base: Path, where: Path) -> str:
    """Every `<!-- results:MODEL:begin -->` ... `<!-- results:MODEL:end -->` of a model card, filled."""
    for model in dict.fromkeys(m.group("model") for m in CARD_MARKER.finditer(text)):
        text = replace_between(text, f"<!-- results:{model}:begin -->", f"<!-- results:{model}:end -->",
                               model_section(found, model, folder, base), where)
    return text


def index_table(found: list[Entry], folder: Path) -> str:
    """The results README's index: every JSON file, newest first."""
    others = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix not in (".json", ".png", ".md"))
    stems = sorted((e.name[:-len(".json")] for e in found), key=len, reverse=True)
    extra: dict[str, list[str]] = {}
    for name in others:  # a profile beside its JSON: the longest JSON name its name starts with
        stem = next((s for s in stems if name.startswith(s + "_")), None)
        extra.setdefault(stem or "", []).append(name)
    about = (f"{len(found)} JSON files, newest first. Machine: the file's own `device` (threads: torch's; the GGUF "
             "cost curves record none: the one their notes name).")
    lines = [made_by(folder, folder), "", about, "",
             "| file | date | machine | model | what it measures | headline |", "| --- | --- | --- | --- | --- | --- |"]
    for entry in sorted(found, key=lambda e: (e.order, e.name), reverse=True):
        stem = entry.name[:-len(".json")]
        beside = [f"[png]({stem}.png)"] if (folder / f"{stem}.png").is_file() else []
        beside += [f"[{name[len(stem) + 1:].rsplit('.', 1)[0]}]({name})" for name in extra.get(stem, [])]
        files = link(entry.name, folder, folder) + (f" ({', '.join(beside)})" if beside else "")
        text = [entry.what, entry.headline]
        text = [t.replace("|", "\\|").replace("\n", " ") for t in text]
        lines.append(f"| {files} | {entry.date} | {entry.machine} | {entry.model} | {text[0]} | {text[1]} |")
    if extra.get(""):
        lines += ["", "Other files: " + ", ".join(link(n, folder, folder) for n in extra[""]) + "."]
    return "\n".join(lines) + "\n"


def replace_between(text: str, begin: str, end: str, body: str, where: Path) -> str:
    start, stop = text.find(begin), text.find(end)
    if start < 0 or stop < start:
        raise SystemExit(f"{where}: the markers {begin} and {end} are missing")
    return text[:start + len(begin)] + "\n" + body + text[stop:]


def replace_below(text: str, marker: str, body: str, where: Path) -> str:
    start = text.find(marker)
    if start < 0:
        raise SystemExit(f"{where}: the marker {marker} is missing")
    return text[:start + len(marker)] + "\n" + body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the folder of JSON files")
    parser.add_argument("--readme", type=Path, default=README, help="the README whose results section is written")
    parser.add_argument("--index", type=Path, help="the index README (default: RESULTS/README.md)")
    parser.add_argument("--card", type=Path, default=CARD, help="the model card whose per-model results are written "
                        "(its `<!-- results:MODEL:begin -->` markers; skipped where the file is missing)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file is stale")
    args = parser.parse_args(argv)
    index = args.index or args.results / "README.md"
    found = entries(args.results)
    wanted = {
        args.readme: replace_between(args.readme.read_text(encoding="utf-8"), BEGIN, END,
                                     results_section(found, args.results, args.readme.parent), args.readme),
        index: replace_below(index.read_text(encoding="utf-8"), INDEX, index_table(found, args.results), index),
    }
    if args.card.is_file():
        wanted[args.card] = card_sections(args.card.read_text(encoding="utf-8"), found, args.results,
                                          args.card.parent, args.card)
    stale = [path for path, text in wanted.items() if path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path}: stale; run python benchmarks/results_tables.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path], encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
