"""A GGUF file as a model: checked once, known by its content, converted once into a `transformers` directory.

Every cache that belongs to a model (its conversion, hence the kernels' choice and the tree fits keyed by the
converted directory, and the heads shipped for it) is keyed by the file's SHA-256, so two files never share one and a
copy of a file anywhere is the same model. Hashing reads the whole file (a second a 100 MB on these CPUs), so the
digest is remembered per path, size and modification time.
"""

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from .config import cache_root
from .ggml_types import BLOCK_TYPES, FLOAT_TYPES, TYPE_NAMES

MAGIC = b"GGUF"
# the architectures this engine runs from a GGUF file (transformers reads more: it would convert them, but the engine
# has not been tested on them)
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# the tensor types read: float ones and the blocks of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, which files
# made as Q4_0 ... Q8_0, Q4_K_M, Q5_K_M and Q6_K hold
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
SOURCE = "gguf_source.json"  # in a conversion: the file it came from and that file's SHA-256
CHUNK = 1 << 24  # bytes hashed a read
# a metadata value's struct format by GGUF's type number (8: string, 9: array, read apart)
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def digest(path: Path) -> tuple[str, Path]:
    """The file's SHA-256, and where it is remembered per path, size and modification time (converted_dir writes it
    there once the file has been converted: a file that fails leaves nothing in the cache)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}".encode()).hexdigest()
    memo = cache_root() / "gguf-digests" / f"{key[:32]}.txt"
    if memo.is_file():
        return memo.read_text().strip(), memo
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest(), memo


def check(path: Path) -> str:
    """Reads the file's header and tensor table; returns its architecture. A ValueError in one line where it is not a
    whole GGUF file, holds an architecture this engine does not run, or a tensor type it does not read."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        architecture = str(reader.fields["general.architecture"].contents())
    except (ValueError, KeyError, IndexError, OSError) as error:
        raise ValueError(f"model: {path} is not a readable GGUF file (truncated or corrupt?): {error}") from None
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model: {path} is a GGUF file of architecture {architecture!r}, which this engine does not "
                         f"run (it runs {', '.join(ARCHITECTURES)})")
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in TENSOR_TYPES:
            raise ValueError(f"model: {path}: tensor {tensor.name} is of type {tensor.tensor_type.name}, which this "
                             f"engine does not read (it reads {', '.join(TENSOR_TYPES)})")
    return architecture


def model_dir(path: Path, weights: bool = False) -> Path:
    """The file's model as a `transformers` directory under the cache, made once per content (the file checked
    first): its config, tokenizer and generation config, which `load` builds the model from, and with `weights` its
    float32 weights too (a conversion: for stock kernels, a GPU, MEDUSA-2's float backbone)."""
    path = Path(path).expanduser()
    if not is_gguf(path):
        raise ValueError(f"model: {path} is not a GGUF file")
    sha, memo = digest(path)
    target = cache_root() / "models" / f"gguf-{sha[:16]}{'-float32' if weights else ''}"
    if not (target / "config.json").is_file():  # written last of all, by a rename
        convert(path, sha, target, weights)
    remember(memo, sha)
    return target


def remember(memo: Path, sha: str) -> None:
    """The digest remembered (digest's `memo`), once the file has been read whole."""
    if not memo.is_file():
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(sha + "\n")
        tmp.replace(memo)


def convert(path: Path, sha: str, target: Path, weights: bool) -> None:
    """Writes the file's config, tokenizer and generation config (and, `weights`, its float32 weights) to `target`,
    atomically (a failed or killed conversion leaves nothing)."""
    check(path)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if weights:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        model.hf_quantizer = None  # the weights are dequantized now: save them as a plain model
        del model.config.quantization_config
    else:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        config.__dict__.pop("quantization_config", None)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.clean_up_tokenization_spaces = False  # a BPE tokenizer: the clean-up would only warn (5.17) or harm
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        if weights:
            model.save_pretrained(tmp)
        else:
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / SOURCE).write_text(json.dumps({"file": str(path.resolve()), "sha256": sha}) + "\n")
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():  # another process may have won the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def source_digest(directory: str | os.PathLike) -> str | None:
    """The SHA-256 of the GGUF file a converted directory came from; None for any other model."""
    source = Path(directory) / SOURCE
    return json.loads(source.read_text())["sha256"] if source.is_file() else None


class Tensor(NamedTuple):
    """A tensor of a GGUF file: its type's ggml number, its shape as `torch` has it ([rows, row]), where its bytes
    begin in the file and how many there are."""

    kind: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def tensor_table(path: Path) -> tuple[dict[str, Tensor], dict[str, object]]:
    """The file's tensors by name and its scalar metadata (arrays skipped: a 262k-token vocabulary is read by the
    tokenizer's own loader), from the header alone; a ValueError where the file is not whole."""
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        reader = Header(f, head)
        if reader.take(4) != MAGIC or reader.scalar("<I") not in (2, 3):
            raise ValueError(f"model: {path} is not a GGUF file of version 2 or 3")
        count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
        metadata = {}
        for _ in range(kv_count):
            key = reader.string()
            value = reader.value(reader.scalar("<I"))
            if value is not None:
                metadata[key] = value
        infos = []
        for _ in range(count):
            name, dims = reader.string(), reader.scalar("<I")
            shape = tuple(reader.scalar("<Q") for _ in range(dims))[::-1]  # ggml lists the row's length first
            infos.append((name, shape, reader.scalar("<I"), reader.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        start = -(-reader.position // alignment) * alignment
    size, tensors = path.stat().st_size, {}
    for name, shape, kind, offset in infos:
        if kind not in TYPE_NAMES:
            raise ValueError(f"model: {path}: tensor {name} is of type {kind}, which this engine does not read")
        weights = math.prod(shape)
        float_bytes = FLOAT_TYPES[kind].itemsize if kind in FLOAT_TYPES else 0
        _, per_block, block_bytes = BLOCK_TYPES.get(TYPE_NAMES[kind], (0, 1, float_bytes))
        tensors[name] = Tensor(kind, shape, start + offset, weights // per_block * block_bytes)
        if start + offset + tensors[name].nbytes > size:
            raise ValueError(f"model: {path} is not a readable GGUF file (truncated or corrupt?): tensor {name} "
                             f"ends past the file's {size} bytes")
    return tensors, metadata


class Header:
    """Reads a GGUF header from an open file, a megabyte at a time."""

    def __init__(self, f, head: bytes):
        self.f, self.data, self.position, self.base = f, head, 0, 0

    def take(self, n: int) -> bytes:
        while self.position + n > self.base + len(self.data):
            more = self.f.read(1 << 20)
            if not more:
                raise ValueError("the header ends early (truncated or corrupt?)")
            self.data = self.data[self.position - self.base:] + more
            self.base = self.position
        at = self.position - self.base
        self.position += n
        return self.data[at:at + n]

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, kind: int):
        """A value of GGUF type `kind`; arrays are skipped (None)."""
        if kind == 8:
            return self.string()
        if kind == 9:
            item, n = self.scalar("<I"), self.scalar("<Q")
            for _ in range(n) if item in (8, 9) else ():
                self.value(item)
            if item not in (8, 9):
                self.take(n * struct.calcsize(SCALARS[item]))
            return None
        if kind not in SCALARS:
            raise ValueError(f"metadata of unknown type {kind} (corrupt?)")
        return self.scalar(SCALARS[kind])


def mapped(path: Path) -> torch.Tensor:
    """The whole file as a uint8 tensor over its pages (mapped copy-on-write: pages load from the file as they are
    used, and stay the page cache's until something writes them, which nothing does)."""
    with open(path, "rb") as f:
        pages = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return torch.frombuffer(pages, dtype=torch.uint8)


def load(path: Path):
    """A GGUF file's model with every linear (and the embedding) on the file's blocks, read in place from the mapped
    file (kernels.NativeLinear with `blocks`, GgufEmbedding), the rest (norms, float tensors) read into float32;
    config and tokenizer from model_dir. Peak memory is the norms and the pages of the file the passes touch.
    -> (model, tokenizer)"""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from .kernels import NativeLinear, load_native

    load_native()  # the blocks are read by the native kernels
    path = Path(path).expanduser()
    directory = model_dir(path)
    tensors, metadata = tensor_table(path)
    config = AutoConfig.from_pretrained(directory)
    with init_empty_weights(include_buffers=False):  # parameters on the meta device; buffers (rotary) computed
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(directory)
    data = mapped(path)
    architecture = metadata["general.architecture"]
    names = gguf_names(model, architecture)
    text = config.get_text_config()
    for module_name, module in model.named_modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            key = names.get(f"{module_name}.{name}")
            if key not in tensors and module is model.get_output_embeddings():
                key = "token_embd.weight"  # an output tied to the embedding
            if key is None or key not in tensors:
                raise ValueError(f"model: {path}: no tensor in the file for {module_name}.{name}")
            tensor = tensors[key]
            if tensor.shape != tuple(parameter.shape):
                raise ValueError(f"model: {path}: tensor {key} is {list(tensor.shape)}, but the file's config makes "
                                 f"{module_name}.{name} {list(parameter.shape)} (corrupt?)")
            rows = permutation(key, tensor.shape[0], text) if architecture == "llama" else None
            raw = data[tensor.offset:tensor.offset + tensor.nbytes]
            if tensor.kind in FLOAT_TYPES:
                values = raw.view(FLOAT_TYPES[tensor.kind]).reshape(tensor.shape).float()
                if architecture == "gemma3" and key.endswith("norm.weight"):
                    values = values - 1  # llama.cpp stores Gemma's (1 + w) RMSNorm weights as 1 + w
                setattr(module, name, torch.nn.Parameter(values if rows is None else values[rows], requires_grad=False))
                continue
            blocks = raw.view(tensor.shape[0], -1)
            module.register_buffer("blocks", blocks if rows is None else blocks[rows], persistent=False)
            module.kind = tensor.kind
            module.__class__ = NativeLinear if isinstance(module, torch.nn.Linear) else GgufEmbedding
            placeholder = torch.full((), float("nan")).expand(parameter.shape)
            setattr(module, name, torch.nn.Parameter(placeholder, requires_grad=False))
    if config.get_text_config().tie_word_embeddings:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return model.eval(), tokenizer


def gguf_names(model, architecture: str) -> dict[str, str]:
    """The file's tensor name of each of the model's parameters (`gguf`'s own name map)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    name_map = get_tensor_name_map(arch, model.config.get_text_config().num_hidden_layers)
    names = {}
    for full in dict(model.named_parameters(remove_duplicate=False)):
        module, _, suffix = full.rpartition(".")
        if (found := name_map.get_name(module)) is not None:
            names[full] = f"{found}.{suffix}"
    return names


def permutation(key: str, rows: int, config) -> torch.Tensor | None:
    """llama.cpp stores a Llama's query and key rows permuted for its rotary layout (convert_hf_to_gguf's permute);
    the rows as `transformers` has them, as transformers' GGUF loader undoes it. None for every other tensor."""
    if ".attn_q." not in key and ".attn_k." not in key:
        return None
    heads = config.num_attention_heads if ".attn_q." in key else config.num_key_value_heads
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


class GgufEmbedding(torch.nn.Embedding):
    """An embedding whose rows are a GGUF file's blocks (`blocks`, `kind`, as a GGUF NativeLinear's): a token's row is
    decoded when it is looked up (medusa::dequantize_gguf: bitwise the `gguf` package's values), and scaled as the
    module it replaced scaled it (Gemma's `embed_scale`, sqrt(hidden)); `weight` a placeholder."""

    kind: int = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from .kernels import native_ops

        rows = native_ops().dequantize_gguf(self._buffers["blocks"][ids.reshape(-1)], self.kind).view(*ids.shape, -1)
        scale = self._buffers.get("embed_scale")
        return rows if scale is None else rows * scale.to(rows.dtype)
