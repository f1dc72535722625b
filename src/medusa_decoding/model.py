"""MedusaModel: a `transformers` causal LM, its tokenizer, MEDUSA heads and a tree, behind one API.

>>> medusa = MedusaModel.from_pretrained()              # the embedded SmolLM2-135M-Instruct
>>> out = medusa.generate("Name three colours.", max_new_tokens=32)
>>> out.text, out.acceleration_rate
>>> medusa.generate("Name three colours.", tree=[3, 2])   # a tree for this call alone (Cartesian sizes)
"""

import json
import os
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from . import embedded, formats
from .base import eos_ids, load_base, with_adapter
from .calibrate import HeadsCalibration, auto_tree, choose_kernels, confident_yield, read_accuracy
from .config import DEFAULT_TREE, GenerationConfig, HeadsConfig, ServerConfig
from .conversation import chat_ids, is_raw
from .corpus import CorpusIndex
from .formats import ADAPTER_DIR, MERGED_DIR, TREE_NAME
from .guard import Ladder
from .heads import MedusaHeads
from .kernels import (
    NativeLinear,
    cpu_float32,
    native_available,
    native_linears,
    reset_kernels,
    resolve_engine,
    resolve_kernels,
    set_guess_vocab,
    use_kernels,
)
from .text import Requests, Step, TextPieces, admit, check_text
from .tree import Mode, Tree, parse_tree


@dataclass
class GenerationOutput:
    """What one request produced. accept_lengths: tokens per forward pass, the prefill's 1 first; tree_sizes: the
    candidates each of those passes verified (the prefill's 0 first; `--tree auto` picks them step by step)."""

    token_ids: list[int] = field(default_factory=list)  # generated tokens only
    accept_lengths: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)  # per forward pass, the tokens only a draft proposed
    text: str = ""
    seconds: float = 0.0
    first_token_seconds: float = 0.0  # the prefill, to the first token
    finish: str | None = None  # why it ended, as Step.finish

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def acceleration_rate(self) -> float:
        return len(self.token_ids) / max(self.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0

    def add_step(self, step: Step) -> None:
        """One more forward pass of the request: its tokens, and the answer as that pass left it."""
        self.token_ids += step.tokens
        self.accept_lengths.append(len(step.tokens))
        self.tree_sizes.append(step.tree_size)
        self.drafted.append(step.drafted)
        self.text, self.finish = step.text, step.finish


class MedusaModel:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        heads: MedusaHeads,
        tree: Tree | Ladder | None = None,
        kernels: str = "stock",
        engine: str = "eager",
    ):
        """tree: the one every step verifies, or a Ladder the guard picks from step by step (`--tree auto`); a call
        may name its own (`trees_for`). kernels: what runs the model's layers (kernels.resolve_kernels: "auto"
        untimed; from_pretrained times them on a CPU, `fastest_kernels`); anything but stock kernels on the eager
        engine changes `model` in place. engine: what runs the steps (kernels.resolve_engine)."""
        config = model.config.get_text_config()
        heads.check_compatible(config.hidden_size, model.get_output_embeddings().out_features, model.name_or_path,
                               config.num_hidden_layers)
        # heads another MedusaModel switched to its kernels start afresh (q8's scales stay float16: not cast by .to)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.heads = reset_kernels(heads).to(model.device, model.dtype).eval()
        self.heads_dir: Path | None = None  # where from_pretrained found the heads (and any calibration)
        self.corpus: CorpusIndex | None = None  # the index of the model's answers found with them (corpus.py)
        self.kernels = resolve_kernels(kernels, model.device, model.dtype)
        self.compiled = resolve_engine(engine, model.device)  # decodes on the compiled engine (compiled.py)
        use_kernels(model, self.kernels, self.compiled)
        if any(isinstance(m, NativeLinear) for m in model.modules()):
            native_linears(self.heads, q8=self.kernels == "q8")
        self.trees = self.checked(tree if tree is not None else
                                  Tree.from_spec([p for p in DEFAULT_TREE if len(p) <= heads.config.num_heads]))
        self.eos_ids = eos_ids(model, tokenizer)

    @property
    def tree(self) -> Tree:
        """The tree decoding starts with (under `--tree auto` the guard moves from it); setting one fixes it."""
        return self.trees.tree

    @tree.setter
    def tree(self, tree: Tree) -> None:
        self.trees = self.checked(tree)

    def trees_for(self, tree=None) -> Ladder:
        """The trees one call decodes with: `tree` in any form tree.parse_tree takes, as from_pretrained reads it (a
        mode from the heads' calibration), or a Ladder; None: the model's own. The model itself is left as it was.

        >>> medusa.trees_for([2, 2]).tree.num_nodes    # Cartesian sizes: 2 + 2 * 2 candidates and the root
        7
        """
        tree = tree if isinstance(tree, Ladder) else parse_tree(tree)
        if tree is None:
            return self.trees
        if isinstance(tree, Mode):
            return self.mode_trees(tree, read_accuracy(self.heads_dir) if self.heads_dir is not None else None)
        return self.checked(tree)

    def checked(self, tree: Tree | Ladder) -> Ladder:
        """A tree as a Ladder of one, or a Ladder, whose every tree the heads reach (ValueError naming the tree)."""
        ladder = tree if isinstance(tree, Ladder) else Ladder.fixed(tree)
        for each in ladder.trees:
            each.check_heads(self.heads.config.num_heads, self.heads.config.vocab_size)
        return ladder

    def mode_trees(self, mode: Mode, calibration: HeadsCalibration | None) -> Ladder:
        """A mode's trees (tree.Mode), from the heads' calibration where they have one, else from the model's own;
        read after the kernels are chosen: they set the latency."""
        if mode.size:  # "confident:N"
            return Ladder.fixed(Tree.from_spec([mode.size]), confident=True,
                                tokens=confident_yield(calibration, mode.size) if calibration else 1.0)
        trees = self.trees if calibration is None else auto_tree(self, self.heads_dir, calibration,
                                                                 confident=mode.name == "confident")
        return replace(trees, confident=True) if mode.name == "confident" else trees

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike | None = None,
        heads: str | os.PathLike | MedusaHeads | None = None,
        *,
        tree="auto",
        num_heads: int = 4,
        num_layers: int = 1,
        projection: str = "shared",
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        kernels: str = "auto",
        engine: str = "auto",
    ) -> "MedusaModel":
        """Base model (a GGUF file, an embedded model's name, a directory or hub id; None: the embedded default) plus
        heads (directory; None: the heads shipped for the model, an embedded one's, else untrained). A MEDUSA-2
        training output may stand for both.

        tree: any form tree.parse_tree takes: a Tree, a path list, Cartesian sizes (or either as JSON text or a JSON
            file); None: the heads' own `tree.json`, else the default;
            "auto": the trees fitted to this device from the heads' calibration (calibrate.auto_tree), among which
            a guard picks the one that pays most each step, down to plain steps (guard.py); else None's.
            "confident": auto's sizes, but each step's candidates are the likeliest that many under the heads' own
            probabilities (heads_draft.guess_confident); "confident:N": N of them every step.
        device/dtype: default to CUDA in bfloat16 where a GPU exists, else the CPU in float32.
        kernels: "auto" (on a CPU in float32 where the native kernels build, the fastest here of stock, native and
            q8: `fastest_kernels`; else stock), "stock", "native" or "q8" (native with 8-bit activations on GGUF
            blocks: faster, approximate).
        engine: "auto" (compiled on a GPU where torch.compile runs, else eager), "eager" or "compiled" (compiled.py:
            fixed-shape steps through torch.compile; each tree size compiles on first use).
        """
        tree = parse_tree(tree)  # a malformed tree fails before the model loads
        cuda = torch.cuda.is_available()
        device = device or ("cuda" if cuda else "cpu")
        dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
        merged = heads is None and model is not None and (Path(model) / MERGED_DIR / "config.json").is_file()
        if merged:
            model, heads = Path(model) / MERGED_DIR, model  # a MEDUSA-2 training output: heads + merged backbone
        elif heads is None and model is not None and (Path(model) / ADAPTER_DIR / "adapter_config.json").is_file():
            config = json.loads((Path(model) / ADAPTER_DIR / "adapter_config.json").read_text())
            model, heads = config["base_model_name_or_path"], model  # heads + adapter: the base it was trained on
        # a GGUF file runs on its blocks wherever the native kernels do (kernels stock: on its float32 conversion)
        blocks = kernels != "stock" and cpu_float32(device, dtype) and native_available()
        base, tokenizer = load_base(model, dtype, device, blocks=blocks)
        if heads is None:
            heads = embedded.shipped_heads(base.name_or_path)  # an embedded model's, by name or as a file
        if heads is None and model is not None and formats.holds_medusa2_heads(model):
            heads = model  # a MEDUSA-2 directory: the fine-tuned backbone and its heads in the same shards
        heads_dir = Path(heads) if isinstance(heads, (str, os.PathLike)) else None
        if heads_dir is not None and not merged and (heads_dir / ADAPTER_DIR / "adapter_config.json").is_file():
            base = with_adapter(base, heads_dir / ADAPTER_DIR)  # MEDUSA-2 heads see the fine-tuned backbone
        if heads is None:
            config = base.config.get_text_config()
            heads = MedusaHeads(HeadsConfig(config.hidden_size, config.vocab_size, num_heads, num_layers, projection,
                                            base.name_or_path), base.get_output_embeddings())
        return cls.assemble(base, tokenizer, heads, tree, kernels, engine)

    @classmethod
    def assemble(cls, base: PreTrainedModel, tokenizer, heads: str | os.PathLike | MedusaHeads, tree, kernels: str,
                 engine: str = "auto") -> "MedusaModel":
        """A loaded base model with heads (a directory: with its tree.json and its calibration; see from_pretrained)."""
        heads_dir = Path(heads) if isinstance(heads, (str, os.PathLike)) else None
        tree = parse_tree(tree)
        mode = tree if isinstance(tree, Mode) else None  # a tree picked once the calibration is read
        given = tree if mode is None else None
        if heads_dir is not None:
            # the base's vocab: heads sharing its LM head in the reference layout record none
            heads = MedusaHeads.from_pretrained(heads_dir, vocab_size=base.get_output_embeddings().weight.shape[0])
            if given is None and (heads_dir / TREE_NAME).is_file():
                given = parse_tree(json.loads((heads_dir / TREE_NAME).read_text()))
        compiled = resolve_engine(engine, base.device)
        # timed on the eager engine; on the compiled one "auto" is resolve_kernels' untimed pick (compiling each to time
        # it would take minutes)
        kernels = kernels if compiled else fastest_kernels(base, tokenizer, heads, kernels)
        medusa = cls(base, tokenizer, heads, given, kernels, "compiled" if compiled else "eager")
        medusa.heads_dir = heads_dir
        calibration = None
        if heads_dir is not None:
            medusa.corpus = CorpusIndex.load(heads_dir)
            calibration = read_accuracy(heads_dir)
            if calibration is not None and calibration.guess_vocab is not None:
                set_guess_vocab(medusa.model, calibration.guess_vocab)
        if mode is not None:
            medusa.trees = medusa.mode_trees(mode, calibration)
        return medusa

    def with_heads(self, heads: str | os.PathLike | MedusaHeads, tree="auto", engine: str | None = None
                   ) -> "MedusaModel":
        """Other heads (or the same with another tree, or on another engine) on this base model, its weights and
        kernels shared (`medusa bench --rival`). The guess vocabulary is the model's: the one these heads were
        calibrated with from then on; so is the corpus index, unless the heads' directory has its own."""
        view = self.assemble(self.model, self.tokenizer, heads, tree, self.kernels,
                             engine or ("compiled" if self.compiled else "eager"))
        if view.corpus is None:
            view.corpus = self.corpus
        return view

    def warm_up(self, prompt, config: GenerationConfig | None = None, max_new_tokens: int = 8) -> None:
        """A few tokens with every tree the guard may pick and plainly, off the clock, decoded as `config` says: the
        compiled engine compiles each tree size on its first step (and kernels load on their first call). The
        guard's picks run on the host's path (verify_graph, the proposal), a fixed or confident:N tree on the device
        step (compiled.py), greedy or sampled as `config`."""
        config = replace(config or GenerationConfig(), max_new_tokens=max_new_tokens)
        for tree in self.trees.trees:
            self.generate(prompt, config=config,
                          tree=Ladder.fixed(tree, self.trees.confident, guarded=len(self.trees.trees) > 1))
        self.generate(prompt, config=replace(config, medusa=False))

    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """The heads (safetensors + config.json), the tree they decode with and their corpus index, if any."""
        self.heads.save_pretrained(directory)
        if self.corpus is not None:
            self.corpus.save(directory)
        (Path(directory) / TREE_NAME).write_text(json.dumps([list(p) for p in self.tree.paths]) + "\n")

    def encode(self, prompt=None, *, messages=None, raw: bool = False) -> torch.Tensor:
        """A prompt string (chat-templated unless raw or the model has no template), chat messages (raw: as raw text,
        conversation.chat_ids), or token ids -> ids [T]."""
        if messages is None and isinstance(prompt, str) and not is_raw(self.tokenizer, raw):
            messages = [{"role": "user", "content": prompt}]
        if messages is not None:
            if not messages or not any(str(m.get("content", "")).strip() for m in messages):
                raise ValueError("the prompt is empty: messages hold no content")
            for m in messages:
                check_text(str(m.get("content", "")))
            ids = chat_ids(self.tokenizer, messages, generation_prompt=True, raw=raw)
        elif isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty: nothing to continue")
            check_text(prompt)
            ids = self.tokenizer(prompt)["input_ids"]
        elif prompt is not None:
            ids = prompt
        else:
            raise ValueError("give a prompt, messages or token ids")
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("the prompt is empty: nothing to continue")
        return ids.to(self.model.device)

    def encode_many(self, prompt=None, *, messages=None, raw: bool = False) -> list[torch.Tensor] | None:
        """Several prompts (a list of strings, of id lists, or of message lists) -> their ids; one prompt -> None."""
        if messages is not None and messages and isinstance(messages[0], (list, tuple)):
            return [self.encode(messages=m) for m in messages]
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], (str, list, tuple, torch.Tensor)):
            return [self.encode(p, raw=raw) for p in prompt]
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2:
            return [self.encode(p) for p in prompt]
        return None

    def generator(self, config: GenerationConfig) -> torch.Generator | None:
        """A request's own random numbers: seeded by config.seed, or at random; None when greedy."""
        if config.temperature == 0:
            return None
        generator = torch.Generator(self.model.device)
        generator.manual_seed(config.seed if config.seed is not None else torch.seed())
        return generator

    def each_step(self, prompt=None, *, messages=None, raw=False, config: GenerationConfig, streamer=None, tree=None
              ) -> Iterator[Step]:
        """Yields a Step after each forward pass, stop strings applied; tree: this call's own (`trees_for`)."""
        trees = self.trees_for(tree)
        ids = self.encode(prompt, messages=messages, raw=raw)
        if streamer is not None:
            streamer.put(ids[None].cpu())
        requests = Requests(self)
        events = requests.add(0, ids, config, trees)
        while events:
            (_, step), = events
            if streamer is not None:
                streamer.put(torch.tensor(step.tokens))
            yield step
            events = requests.step()
        if streamer is not None:
            streamer.end()

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompt=None, *, messages=None, raw=False, config=None, streamer=None,
                 max_batch: int = ServerConfig.max_batch, tree=None, **overrides):
        """Runs to the end -> a GenerationOutput; several prompts (a list) -> a list of them, decoded in batches of up
        to `max_batch` (each prompt joins as soon as another has finished). tree: this call's own, any form
        `trees_for` takes (None: the model's). overrides: any GenerationConfig field (max_new_tokens=...,
        temperature=...)."""
        config, trees = replace(config or GenerationConfig(), **overrides), self.trees_for(tree)
        if (many := self.encode_many(prompt, messages=messages, raw=raw)) is not None:
            if streamer is not None:
                raise ValueError("streamer: one prompt at a time (transformers' streamers take a batch of one)")
            outputs, start = [GenerationOutput() for _ in many], time.perf_counter()
            for index, step in self.run_batch(many, config, max_batch, trees):  # times from the call (a wait too)
                out, now = outputs[index], time.perf_counter() - start
                out.first_token_seconds = out.first_token_seconds or now
                out.seconds = now if step.done else 0.0
                out.add_step(step)
            return outputs
        out, start = GenerationOutput(), time.perf_counter()
        for step in self.each_step(prompt, messages=messages, raw=raw, config=config, streamer=streamer, tree=trees):
            out.first_token_seconds = out.first_token_seconds or time.perf_counter() - start
            out.add_step(step)
        out.seconds = time.perf_counter() - start
        return out

    def run_batch(self, prompts: list[torch.Tensor], config: GenerationConfig, max_batch: int, tree=None
                  ) -> Iterator[tuple[int, Step]]:
        """(prompt index, Step) per row of every forward pass, up to `max_batch` prompts decoded together; tree: theirs
        (`trees_for`)."""
        requests, waiting, trees = Requests(self), deque(enumerate(prompts)), self.trees_for(tree)
        while requests or waiting:
            events = []
            while admitted := admit(waiting, len(requests), max_batch):  # again where a prefill ended its request
                events += [event for index, ids in admitted for event in requests.add(index, ids, config, trees)]
            events += requests.step() if requests else []
            yield from events

    def stream(self, prompt=None, *, messages=None, raw=False, config=None, max_batch: int = ServerConfig.max_batch,
               tree=None, **overrides) -> Iterator:
        """Yields text as it is accepted; holds back an incomplete character or a possible stop string. Several
        prompts: (prompt index, text) pairs, the answers interleaved as their steps come. tree: as `generate`'s."""
        config, trees = replace(config or GenerationConfig(), **overrides), self.trees_for(tree)
        if (many := self.encode_many(prompt, messages=messages, raw=raw)) is not None:
            pieces = [TextPieces(config.stop) for _ in many]
            for index, step in self.run_batch(many, config, max_batch, trees):
                if piece := pieces[index].add(step.text, step.done):
                    yield index, piece
            return
        pieces = TextPieces(config.stop)
        for step in self.each_step(prompt, messages=messages, raw=raw, config=config, tree=trees):
            if piece := pieces.add(step.text, step.done):
                yield piece


def fastest_kernels(model: PreTrainedModel, tokenizer, heads: MedusaHeads, kernels: str) -> str:
    """kernels="auto" on a CPU in float32 where the native kernels build: of stock, native and q8, the fastest on
    `model` with `heads`, timed once per setup (calibrate.choose_kernels); any other choice as it is."""
    if kernels != "auto" or not cpu_float32(model.device, model.dtype) or not native_available():
        return kernels
    return choose_kernels(model, heads, lambda name: MedusaModel(model, tokenizer, heads, kernels=name))
