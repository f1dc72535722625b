"""The frozen backbone's states at every answer position, computed once for a MEDUSA-1 run with position_batch, and
kept on disk in parts as they are computed: on a CPU they are most of a run's time (about 20 minutes per million
tokens for SmolLM2-135M on 2 cores), so a run killed while computing them goes on from its last part, not from the
start."""

import hashlib
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from ..heads import MedusaHeads
from .positions import answer_positions

logger = logging.getLogger(__name__)
PART = 256  # conversations a part file holds: about a minute and a half of SmolLM2's states on 2 cores


class AnswerStates(torch.utils.data.Dataset):
    """MEDUSA-1 with position_batch: the frozen backbone's states at every answer position, computed once (each epoch
    would compute the same ones again), so that a batch is positions drawn from many conversations. The heads then
    get many more updates per hour: benchmarks/feature_probe.py showed head 0 held back by its number of updates.
    Items: state [S] (the heads' input state), targets [K], path [K] (tokens t+1..t+K), and with `teacher` ahead
    [K, H] (ahead_states; kept in bfloat16: K times the size of the states).

    store: a directory for the parts (part-N.safetensors, each with a fingerprint of the backbone, the heads' inputs
    and its conversations); a part whose fingerprint matches is read back, any other is computed again. backbone:
    backbone_key(model, heads, teacher), hashed once for a run's training and held-out sets."""

    def __init__(self, model: PreTrainedModel, heads: MedusaHeads, examples: list[dict], pad_id: int,
                 batch_size: int, what: str, store: Path, backbone: str, teacher: bool = False):
        from tqdm.auto import tqdm

        examples = sorted(examples, key=lambda e: len(e["input_ids"]))  # batches of alike lengths: little padding
        parts = []
        with tqdm(total=len(examples), desc=f"states of {what}", unit="conv") as bar:
            for start in range(0, len(examples), PART):
                part = examples[start: start + PART]
                path, key = store / f"part-{start // PART:05d}.safetensors", part_key(backbone, part)
                found = read_part(path, key)
                if found is None:
                    found = compute_part(model, heads, part, pad_id, batch_size, teacher, bar)
                    write_part(path, key, found)
                else:
                    bar.update(len(part))
                parts.append(found)
        self.state = torch.cat([p["state"] for p in parts])
        self.targets = torch.cat([p["targets"] for p in parts])
        self.path = torch.cat([p["path"] for p in parts])
        self.ahead = torch.cat([p["ahead"] for p in parts]) if teacher else None

    def __len__(self) -> int:
        return len(self.state)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"state": self.state[i], "targets": self.targets[i], "path": self.path[i]}
        return item if self.ahead is None else item | {"ahead": self.ahead[i]}


def compute_part(model, heads, examples: list[dict], pad_id: int, batch_size: int, teacher: bool, bar
                 ) -> dict[str, torch.Tensor]:
    found = []
    batches = answer_positions(model, heads, examples, pad_id, batch_size, teacher)
    for start, (state, targets, path, *ahead) in zip(range(0, len(examples), batch_size), batches):
        found.append((state.cpu(), targets.cpu(), path.cpu(), *(a.cpu().bfloat16() for a in ahead)))
        bar.update(len(examples[start: start + batch_size]))
    state, targets, path, *ahead = zip(*found)
    part = {"state": torch.cat(state), "targets": torch.cat(targets, 1).T.contiguous(), "path": torch.cat(path)}
    return part | ({"ahead": torch.cat(ahead[0])} if ahead else {})


def backbone_key(model: PreTrainedModel, heads: MedusaHeads, teacher: bool) -> str:
    """What the states depend on besides the conversations: every backbone weight, the layers the heads read, the
    number of heads (targets and path) and whether the states ahead are kept."""
    digest = hashlib.sha256(repr((heads.config.feature_layers, heads.config.num_heads, teacher)).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def part_key(backbone: str, examples: list[dict]) -> str:
    digest = hashlib.sha256(backbone.encode())
    for example in examples:
        digest.update(repr((example["input_ids"], example["labels"])).encode())
    return digest.hexdigest()


def read_part(path: Path, key: str) -> dict[str, torch.Tensor] | None:
    """The part at `path` if it holds `key`'s states; None if absent, another key's, or unreadable (a run killed while
    writing it leaves no such file: write_part writes aside, then renames)."""
    if not path.exists():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()} if (f.metadata() or {}).get("key") == key else None
    except Exception as error:  # noqa: BLE001 - a damaged part is computed again, not trusted
        logger.warning("states: %s is unreadable (%s); computing it again", path, error)
        return None


def write_part(path: Path, key: str, part: dict[str, torch.Tensor]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_suffix(f".{os.getpid()}.tmp")  # processes of one run write the same part: each its own file
    save_file(part, str(aside), metadata={"key": key})
    os.replace(aside, path)
