"""benchmarks/results_tables.py on a folder of synthetic result files: the README's tables keep only the newest result
of each machine, benchmark, model and build, the index lists every JSON file (those it cannot read as such), the
hand-written text outside the markers stays, and --check tells a stale file from a fresh one."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "results_tables.py"
XEON = "Intel(R) Xeon(R) Processor (family 6, model 106), 2 threads"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("results_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def bench(date: str, medusa: float, plain: float, device: str = XEON, questions: str = "mt_bench_question.jsonl",
          llama: float | None = None, heads: str | None = None) -> dict:
    speeds = {"medusa": medusa, "plain": plain, "transformers": 10.0} | ({"llama.cpp": llama} if llama else {})
    return {"date": date, "device": device, "lossless": True,
            "config": {"model": "SmolLM2-135M-Instruct", "kernels": "q8", "kind": "hydra", "max_new_tokens": 256,
                       "questions": [f"../shared/data/{questions}"], "heads": heads, "heads_trained": True},
            "overall": {"turns": 48, "speedup": medusa / plain, "acceleration_rate": 2.5, "tokens_per_s": speeds}}


@pytest.fixture
def folder(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    files = {
        "old_mt.json": bench("2026-01-01", 50.0, 40.0),  # replaced by new_mt: same machine, benchmark, model, build
        "new_mt.json": bench("2026-02-01", 90.0, 60.0, llama=70.0),
        "new_mt_avx2.json": bench("2026-02-01", 80.0, 58.0),  # the AVX2 build: a row of its own
        "trial_mt.json": bench("2026-03-01", 99.0, 60.0, heads="/work/runs/trial"),  # heads not shipped: index only
        "gpu_mt.json": bench("2026-02-02", 300.0, 200.0, device="NVIDIA H200"),
        "curve.json": [{"model": "gemma3", "device": XEON, "kernels": "q8", "isa": "avx512", "context": 128,
                        "plain_ms": 20.0, "llama_cpp_ms": 25.0, "plain_vs_llama_cpp": 1.25}],
        "probe.json": {"date": "2026-01-05", "top1_agreement": 0.98, "mean_kl_native_to_q8": 0.002},
        "odd.json": {"date": "2026-01-03", "something": [1, 2]},
    }
    for name, data in files.items():
        (results / name).write_text(json.dumps(data))
    (results / "broken.json").write_text("{not json")
    (results / "new_mt.png").write_bytes(b"png")
    (results / "README.md").write_text("# Results\n\nWritten by hand.\n\n<!-- index -->\nold table\n")
    (tmp_path / "README.md").write_text("# Project\n\n## Results\n\n<!-- results:begin -->\nold\n<!-- results:end -->\n"
                                        "\n## After\n")
    (tmp_path / "MODEL_CARD.md").write_text("# Cards\n\n<!-- results:Gemma 3 270M:begin -->\n"
                                            "<!-- results:Gemma 3 270M:end -->\n")
    return tmp_path


def run(tables, folder, *extra):
    return tables.main(["--results", str(folder / "results"), "--readme", str(folder / "README.md"),
                        "--card", str(folder / "MODEL_CARD.md"), *extra])


def test_the_readme_gets_one_table_per_machine_with_the_newest_result_of_each_benchmark(tables, folder):
    assert run(tables, folder) == 0
    readme = (folder / "README.md").read_text()
    assert readme.startswith("# Project\n\n## Results\n\n<!-- results:begin -->\n") and readme.endswith(
        "<!-- results:end -->\n\n## After\n")
    section = readme.split("<!-- results:begin -->")[1].split("<!-- results:end -->")[0]
    headings = [line for line in section.splitlines() if line.startswith("#### ")]
    assert headings == ["#### Intel Xeon Ice Lake (family 6, model 106), 2 threads", "#### NVIDIA H200"]
    cpu = section.split("#### NVIDIA H200")[0]
    assert "old_mt.json" not in section and "trial_mt.json" not in section  # replaced; heads not shipped
    rows = [line for line in cpu.splitlines() if line.startswith("| ") and "json" in line]
    assert [r.split("[")[1].split("]")[0] for r in rows] == ["new_mt.json", "new_mt_avx2.json", "curve.json"]
    new = [cell.strip() for cell in rows[0].split("|")[1:-1]]
    assert new[:9] == ["MT-Bench, 256 tokens (48 turns)", "SmolLM2-135M-Instruct", "q8", "90.0", "60.0", "70.0",
                       "1.50x", "2.50", "yes"]
    assert "(results/new_mt.json) (2026-02-01)" in new[9]
    assert rows[1].split("|")[3].strip() == "q8, AVX2 build"
    curve = [cell.strip() for cell in rows[2].split("|")[1:-1]]
    assert curve[1:7] == ["Gemma 3 270M", "q8", "—", "50.0", "40.0", "—"]  # 1000 / ms
    assert "300.0" in section.split("#### NVIDIA H200")[1]
    card = (folder / "MODEL_CARD.md").read_text()
    assert "curve.json" in card and "new_mt.json" not in card  # a card's table: its own model's rows


def test_the_index_lists_every_json_file_and_keeps_the_header(tables, folder):
    run(tables, folder)
    index = (folder / "results" / "README.md").read_text()
    assert index.startswith("# Results\n\nWritten by hand.\n\n<!-- index -->\n") and "old table" not in index
    rows = {line.split("]")[0][3:]: line for line in index.splitlines() if line.startswith("| [")}
    assert set(rows) == {p.name for p in (folder / "results").glob("*.json")}
    # newest first: files without a date of their own or from git are taken for the newest, not yet committed
    assert list(rows)[:4] == ["curve.json", "broken.json", "trial_mt.json", "gpu_mt.json"]
    assert "| not committed |" in rows["curve.json"] and "| 2026-03-01 |" in rows["trial_mt.json"]
    assert "[png](new_mt.png)" in rows["new_mt.json"] and "MEDUSA 90.0 tok/s, 1.50x plain" in rows["new_mt.json"]
    assert "1.29x llama.cpp" not in rows["new_mt.json"]  # only what the file holds
    assert "not read: JSONDecodeError" in rows["broken.json"]
    assert "not read: a shape this script does not know" in rows["odd.json"]
    assert "top-1 agreement 98.0%" in rows["probe.json"]
    assert "from trial" in rows["trial_mt.json"]  # whose heads


def test_check_passes_when_fresh_fails_when_stale_and_writes_nothing(tables, folder):
    assert run(tables, folder) == 0
    written = {p: p.read_text() for p in (folder / "README.md", folder / "results" / "README.md")}
    assert run(tables, folder) == 0 and run(tables, folder, "--check") == 0  # the same output every time
    assert {p: p.read_text() for p in written} == written
    (folder / "results" / "newest.json").write_text(json.dumps(bench("2026-04-01", 100.0, 50.0)))
    assert run(tables, folder, "--check") == 1
    assert {p: p.read_text() for p in written} == written
