"""`medusa bench`: MEDUSA against plain decoding (same engine) and `transformers` generate, on MT-Bench; and, where
asked, llama.cpp on the same GGUF file (llamacpp.py), with both engines' step latency over 1, 4, 8 and 16 tokens.

Every turn of every question is answered by the decoders one after the other (their order rotating
from turn to turn), so machine noise hits them alike. Turn 2's history holds the PLAIN decoder's answer to
turn 1, so all three see the same prompt (greedy MEDUSA's answer is the same anyway: it is lossless).

questions.py reads the questions, decoders.py runs each decoder on a turn, run.py the whole benchmark, measures.py
the calibration's measures beside it, results.py the report and its table, plots.py its PNG.

>>> questions = read_questions("mt_bench_question.jsonl", categories=["coding"], limit=2)
>>> report = benchmark(MedusaModel.from_pretrained(), questions, GenerationConfig(max_new_tokens=64))
>>> report["overall"]["speedup"], report["lossless"]
"""

from .decoders import DECODERS, LLAMA_CPP, NO_CORPUS, NO_LOOKUP, hf_generate
from .measures import CALIBRATION
from .plots import plot
from .questions import Question, read_questions
from .results import agreed_prefix, table
from .run import benchmark

__all__ = ["CALIBRATION", "DECODERS", "LLAMA_CPP", "NO_CORPUS", "NO_LOOKUP", "Question", "agreed_prefix", "benchmark",
           "hf_generate", "plot", "read_questions", "table"]
