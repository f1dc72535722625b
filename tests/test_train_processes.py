"""`medusa train` across processes (issue 72): two CPU processes (torchrun, gloo; what `accelerate launch
--num_processes 2` starts) train the heads one process trains for the same global batch, within float rounding;
a two-process run killed mid-way resumes to the same heads; one process writes the checkpoints and the output."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from safetensors.torch import load_file

STEPS, SAVE_STEPS, POSITIONS = 6, 2, 16  # a global batch of 16 answer positions: 8 a process when there are two


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny base model and conversations whose answers differ in length (the processes' batches then hold different
    numbers of targets per head: the losses' means must still be the global batch's)."""
    root = tmp_path_factory.mktemp("processes")
    tokenizer = tiny_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    lines = [json.dumps({"id": str(n), "conversations": [
        {"from": "human", "value": "w1 w2 w3"},
        {"from": "gpt", "value": " ".join(f"w{n + i}" for i in range(4 + n % 9))}]}) for n in range(24)]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


def command(setup, output, processes: int, *extra, script: list[str] = ("-m", "medusa_decoding.cli")) -> list[str]:
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                                    str(29500 + os.getpid() % 1000)] if processes > 1 else [])
    return [*launcher, *script, "train", "--data", str(setup / "data.jsonl"), "--model", str(setup / "base"),
            "--output", str(output), "--num-heads", "2", "--max-steps", str(STEPS), "--save-steps", str(SAVE_STEPS),
            "--position-batch", str(POSITIONS // processes), "--batch-size", "4", "--eval-fraction", "0",
            "--lr", "1e-2", "--warmup-steps", "0", *extra]


def run(args: list[str], **env) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0 or env, done.stderr[-3000:]
    return done


def heads(directory) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


@pytest.fixture(scope="module")
def two_processes(setup) -> Path:
    """A whole two-process run: what one process must match, and what a killed one must resume to."""
    run(command(setup, setup / "two", 2))
    return setup / "two"


def test_two_processes_train_the_heads_one_process_trains(setup, two_processes, tmp_path):
    run(command(setup, tmp_path / "one", 1))
    one, two = heads(tmp_path / "one"), heads(two_processes)
    assert one.keys() == two.keys()
    for name in one:
        assert torch.allclose(one[name], two[name], rtol=1e-4, atol=1e-6), name
    initial = torch.zeros_like(one["heads.0.0.linear.weight"])  # W1 starts at zero: the heads did learn
    assert not torch.equal(one["heads.0.0.linear.weight"], initial)
    saved = [sorted(p.name for p in (out / "checkpoints").iterdir()) for out in (tmp_path / "one", two_processes)]
    assert saved[0] == saved[1] and saved[0]  # one process saves, as one process alone does


def test_a_killed_two_process_run_resumes_to_the_same_heads(setup, two_processes, tmp_path):
    killed = run(command(setup, tmp_path / "killed", 2, script=[str(Path(__file__).with_name("killed_train.py"))]),
                 KILL_AT=str(SAVE_STEPS + 1))  # both processes die in the step after the first checkpoint
    assert killed.returncode != 0 and not (tmp_path / "killed" / "model.safetensors").exists()
    assert (tmp_path / "killed" / "checkpoints" / f"checkpoint-{SAVE_STEPS}").is_dir()
    run(command(setup, tmp_path / "killed", 2, "--resume"))
    whole, resumed = heads(two_processes), heads(tmp_path / "killed")
    assert whole.keys() == resumed.keys()
    assert all(torch.allclose(whole[k], resumed[k], rtol=1e-5, atol=1e-7) for k in whole)
