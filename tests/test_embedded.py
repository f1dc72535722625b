"""The embedded models by name: Gemma 3 270M assembled once from its chunk packages and checked (a corrupt file is
assembled again; parts that do not make the file leave nothing), one line naming the install command where its
packages are missing, and each model answering as itself by name or path, SmolLM2's file first, Gemma's next."""

import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import EXACT_KERNELS

from medusa_decoding import MedusaModel, embedded, gguf_file

GEMMA_PROMPT = "The history of the printing press begins"
# llama.cpp's greedy continuation of GEMMA_PROMPT on the same file (llama-cpp-python 0.3.36, 2 threads): what an
# independent engine reads from these bytes
GEMMA_CONTINUATION = [607, 506, 17410, 529, 506, 16386, 2686, 528, 236743, 236770, 236812, 236810, 236771, 236761,
                      669, 16386]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MEDUSA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_missing_package_is_one_line_naming_the_install_command(cache):
    model = replace(embedded.GEMMA3, chunks=("medusa_no_such_package",))
    with pytest.raises(FileNotFoundError) as error:
        model.gguf_path()
    assert "pip install 'medusa-decoding[gemma]'" in str(error.value) and "\n" not in str(error.value)
    assert not cache.exists()


def test_parts_that_do_not_make_the_file_leave_nothing(tmp_path):
    parts = [tmp_path / "a.part00", tmp_path / "a.part01"]
    parts[0].write_bytes(b"GGUF" + bytes(1000))
    parts[1].write_bytes(bytes(range(256)))
    target = tmp_path / "models" / "a.gguf"
    with pytest.raises(ValueError, match="do not assemble into the file they were cut from"):
        embedded.assemble(parts, target, hashlib.sha256(b"another file").hexdigest())
    assert list(target.parent.iterdir()) == []
    whole = hashlib.sha256(parts[0].read_bytes() + parts[1].read_bytes()).hexdigest()
    embedded.assemble(parts, target, whole)
    assert target.read_bytes() == parts[0].read_bytes() + parts[1].read_bytes()


def test_gemma_is_assembled_once_and_again_where_it_was_corrupted(cache, capsys):
    path = embedded.GEMMA3.gguf_path()
    assert gguf_file.digest(path)[0] == embedded.GEMMA3.sha256
    assert "Gemma Terms of Use" in capsys.readouterr().err  # its terms, where it is assembled
    stat = path.stat()
    assert embedded.GEMMA3.gguf_path() == path and path.stat().st_mtime_ns == stat.st_mtime_ns  # once
    with open(path, "r+b") as f:  # a disk error in the middle of the file
        f.seek(stat.st_size // 2)
        f.write(bytes(64))
    assert embedded.GEMMA3.gguf_path() == path
    assert "does not match its checksum: assembling it again" in capsys.readouterr().err
    assert gguf_file.digest(path)[0] == embedded.GEMMA3.sha256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # nothing half-written beside it


def test_gemma_by_name_or_path_answers_as_gemma_after_smollm2s_file(smollm, tmp_path):
    smollm2 = MedusaModel.from_pretrained(embedded.gguf_path(), kernels=EXACT_KERNELS)
    assert smollm2.model.name_or_path == smollm.model.name_or_path
    gemma = MedusaModel.from_pretrained("gemma-3-270m", kernels=EXACT_KERNELS)
    assert type(gemma.model).__name__ == "Gemma3ForCausalLM" and gemma.tokenizer.chat_template is None
    assert gemma.heads_dir is None  # untrained heads: none ship for it yet
    out = gemma.generate(GEMMA_PROMPT, max_new_tokens=len(GEMMA_CONTINUATION))  # a base model: the prompt raw
    assert out.token_ids == GEMMA_CONTINUATION
    copy = tmp_path / "gemma.gguf"
    copy.symlink_to(embedded.GEMMA3.gguf_path())
    assert gguf_file.model_dir(copy) == gguf_file.model_dir(embedded.GEMMA3.gguf_path())  # the same model
