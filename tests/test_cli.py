"""`medusa generate` and `medusa demo` as a user runs them: a subprocess, its stdout, stderr and exit code."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import EXACT_KERNELS

from medusa_decoding import HeadsConfig, MedusaHeads, MedusaModel
from medusa_decoding.cli import main
from medusa_decoding.cli.measure import heads_trained
from medusa_decoding.config import DEFAULT_MODEL

PROMPT = "Name three primary colours."  # untrained heads still get a few guesses accepted on this one
MAX_NEW_TOKENS = 24
USAGE_ERROR = 2


def medusa(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "medusa_decoding.cli", *args], capture_output=True, text=True, timeout=600
    )


# an explicit tree: --tree auto's guard decodes plainly where trees do not pay on this machine (stock kernels), and
# fitting it costs a run seconds
GENERATE = ("generate", "--prompt", PROMPT, "--max-new-tokens", str(MAX_NEW_TOKENS), "--acceptance", "greedy",
            "--tree", "[[0], [1], [2]]", "--kernels", EXACT_KERNELS)


@pytest.fixture(scope="module")
def generated() -> dict:
    run = medusa(*GENERATE, "--json")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("\n") == 1, run.stdout  # one JSON object, nothing else: progress bars went to stderr
    return json.loads(run.stdout)


def test_generate_json_is_transformers_greedy(generated, smollm):
    messages = [{"role": "user", "content": PROMPT}]
    prompt = torch.tensor([smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                return_dict=False)])
    with torch.inference_mode():
        reference = smollm.model.generate(
            prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=MAX_NEW_TOKENS
        )
    assert generated["token_ids"] == reference[0, prompt.shape[1]:].tolist()
    assert generated["text"] == smollm.tokenizer.decode(generated["token_ids"], skip_special_tokens=True)
    assert set(generated) == {"text", "token_ids", "steps", "accept_lengths", "tree_sizes", "tokens_per_s"}
    assert sum(generated["accept_lengths"]) == len(generated["token_ids"])
    assert generated["steps"] == len(generated["accept_lengths"]) == len(generated["tree_sizes"])
    assert generated["tree_sizes"][0] == 0 and max(generated["tree_sizes"]) > 0  # the prefill, then trees
    assert max(generated["accept_lengths"]) > 1  # the tree was verified and some guesses were accepted
    assert generated["tokens_per_s"] > 0


def test_streamed_text_is_the_json_text(generated):
    run = medusa(*GENERATE)
    assert run.returncode == 0, run.stderr
    assert run.stdout == generated["text"] + "\n"


def test_sampling_options_reach_the_engine(capsys):
    """--temperature alone switches the default acceptance ("auto") to rejection sampling; --seed repeats a run."""
    args = ["generate", "--prompt", PROMPT, "--max-new-tokens", "6", "--temperature", "1.5", "--seed", "3", "--json"]
    runs = []
    for _ in range(2):
        main(args)
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["token_ids"] == runs[1]["token_ids"] and len(runs[0]["token_ids"]) == 6


class Loaded(Exception):
    """Raised in place of loading: what the command asked of the model is all these tests look at."""


@pytest.mark.parametrize(("given", "dtype"), [([], None), (["--dtype", "float32"], torch.float32),
                                              (["--dtype", "bfloat16"], torch.bfloat16)])
def test_dtype_reaches_the_model(given, dtype, monkeypatch, tmp_path):
    """--dtype auto leaves the device's default (bfloat16 on a GPU, float32 on a CPU); a named one is the model's."""
    def from_pretrained(*args, **kwargs):
        raise Loaded(kwargs["dtype"])

    monkeypatch.setattr(MedusaModel, "from_pretrained", from_pretrained)
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [PROMPT]}) + "\n")
    for command in (["generate", "--prompt", PROMPT], ["bench", "--questions", str(questions)]):
        with pytest.raises(Loaded) as loaded:
            main([*command, *given])
        assert loaded.value.args == (dtype,)


def test_an_unknown_dtype_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", PROMPT, "--dtype", "float64"])
    assert exit_.value.code == USAGE_ERROR and "invalid choice: 'float64'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def bad_heads(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("heads")
    MedusaHeads(HeadsConfig(hidden_size=32, vocab_size=96)).save_pretrained(root / "tiny")
    MedusaHeads(HeadsConfig(hidden_size=576, vocab_size=49152)).save_pretrained(root / "corrupt")
    (root / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    return {"root": root, "tiny": root / "tiny", "corrupt": root / "corrupt"}


BAD_INPUTS = {
    "missing model": (lambda h: ["--model", str(h["root"] / "no-such-model")], r"no-such-model does not exist"),
    "bad tree": (lambda h: ["--tree", "[[0], [0, 0, 0]]"], r"tree: not prefix-closed"),
    "tree deeper than heads": (lambda h: ["--tree", "[1, 1, 1, 1, 1]"], r"tree: depth 5 needs 5 heads"),
    "empty prompt": (lambda h: ["--prompt", ""], r"prompt is empty"),
    # bytes that are not UTF-8 reach Python's argv as lone surrogates, which no tokenizer takes
    "prompt not valid text": (lambda h: ["--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")],
                              r"not valid Unicode"),
    "prompt too long": (lambda h: ["--prompt", "word " * 9000], r"exceeds the model's context of 8192 tokens"),
    "heads for another model": (lambda h: ["--heads", str(h["tiny"])], r"built for hidden_size=32, vocab_size=96"),
    "corrupt heads": (lambda h: ["--heads", str(h["corrupt"])], r"corrupt"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_a_message(case, bad_heads, capsys):
    """In-process (main() is what the `medusa` script calls): any other exception would fail this test."""
    extra, message = BAD_INPUTS[case]
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--json", *extra(bad_heads)])
    out, err = capsys.readouterr()
    assert exit_.value.code == USAGE_ERROR, err
    assert out == ""
    assert re.search(message, err), err
    assert "medusa generate: error:" in err


def test_demo_streams_and_compares_both_speeds(smollm):
    run = medusa("demo", "--max-new-tokens", "8")
    assert run.returncode == 0, run.stderr
    out = run.stdout
    for prompt in DEFAULT_MODEL.demo_prompts:
        assert f">>> {prompt}" in out
    speeds = re.findall(r"MEDUSA (\d+\.\d) tok/s \((\d\.\d\d) tokens/step\)  \|  plain (\d+\.\d) tok/s  \|  "
                        r"transformers generate (\d+\.\d) tok/s  \|  identical: yes", out)
    assert len(speeds) == len(DEFAULT_MODEL.demo_prompts), out
    assert all(float(fast) > 0 and float(plain) > 0 and float(hf) > 0 for fast, _, plain, hf in speeds)
    assert re.search(r"^all prompts +\d+ +\d+\.\d +\d\.\d\d +\d+\.\d +\d+\.\d +\d+\.\d\dx +\d+\.\d\dx  yes$", out,
                     re.MULTILINE), out
    assert "(--tree auto)" in out and re.search(r"\b(stock|native|q8) kernels", out), out
    assert ("untrained heads" in out) == (not heads_trained(smollm.heads))  # the same heads the demo loads
