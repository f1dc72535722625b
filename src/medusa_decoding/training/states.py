"""The frozen backbone's states at every answer position, computed once for a MEDUSA-1 run with position_batch, and
kept on disk in parts as they are computed: on a CPU they are most of a run's time, so a run killed while computing
them goes on from its last part, not from the start. Each part names its conversations by their content, so a run on
more data (or another split of it) computes the new conversations' states only."""

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel

from ..heads import MedusaHeads
from .positions import answer_mask, answer_positions

logger = logging.getLogger(__name__)
PART = 256  # conversations a part file holds: the most of its work a run killed while computing states loses
FIELDS = ("state", "targets", "path", "ahead")


class AnswerStates(torch.utils.data.Dataset):
    """MEDUSA-1 with position_batch: the frozen backbone's states at every answer position, computed once (each epoch
    would compute the same ones again), so that a batch is positions drawn from many conversations. The heads then
    get many more updates per hour: benchmarks/feature_probe.py showed head 0 held back by its number of updates.
    Items: state [S] (the heads' input state), targets [K], path [K] (tokens t+1..t+K), and with `teacher` ahead
    [K, H] (ahead_states; kept in bfloat16: K times the size of the states).

    store: a directory of parts (part-<hash>.safetensors), each holding some conversations' positions, their keys
    (conversation_key: the backbone's fingerprint and the conversation) and position counts; the conversations found
    in any readable part are read back, the others computed, PART at a time, into new parts. backbone:
    backbone_key(model, heads, teacher), hashed once for a run's training and held-out sets."""

    def __init__(self, model: PreTrainedModel, heads: MedusaHeads, examples: list[dict], pad_id: int,
                 batch_size: int, what: str, store: Path, backbone: str, teacher: bool = False):
        from tqdm.auto import tqdm

        keys = [conversation_key(backbone, example) for example in examples]
        found = stored(store)  # conversation key -> (part file, first position, positions)
        missing = sorted({key: i for i, key in enumerate(keys) if key not in found}.values(),
                         key=lambda i: len(examples[i]["input_ids"]))  # batches of alike lengths: little padding
        with tqdm(total=len(examples), initial=len(examples) - len(missing), desc=f"states of {what}",
                  unit="conv") as bar:
            for start in range(0, len(missing), PART):
                part = [examples[i] for i in missing[start: start + PART]]
                path = write_part(store, [keys[i] for i in missing[start: start + PART]],
                                  *compute_part(model, heads, part, pad_id, batch_size, teacher, bar))
                found |= index(path)
        self.state, self.targets, self.path, self.ahead = gather(found, keys, teacher)

    def __len__(self) -> int:
        return len(self.state)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        item = {"state": self.state[i], "targets": self.targets[i], "path": self.path[i]}
        return item if self.ahead is None else item | {"ahead": self.ahead[i]}


def compute_part(model, heads, examples: list[dict], pad_id: int, batch_size: int, teacher: bool, bar
                 ) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The examples' positions (FIELDS) and how many each example has, in order."""
    found = []
    batches = answer_positions(model, heads, examples, pad_id, batch_size, teacher)
    for start, (state, targets, path, *ahead) in zip(range(0, len(examples), batch_size), batches):
        found.append((state.cpu(), targets.cpu(), path.cpu(), *(a.cpu().bfloat16() for a in ahead)))
        bar.update(len(examples[start: start + batch_size]))
    state, targets, path, *ahead = zip(*found)
    part = {"state": torch.cat(state), "targets": torch.cat(targets, 1).T.contiguous(), "path": torch.cat(path)}
    counts = [int(answer_mask(torch.tensor([e["labels"]]), heads.config.num_heads)[1].sum()) for e in examples]
    assert sum(counts) == len(part["state"]), "states: positions and their conversations' counts disagree"
    return part | ({"ahead": torch.cat(ahead[0])} if ahead else {}), counts


def backbone_key(model: PreTrainedModel, heads: MedusaHeads, teacher: bool) -> str:
    """What the states depend on besides the conversations: every backbone weight, the layers the heads read, the
    number of heads (targets and path) and whether the states ahead are kept."""
    digest = hashlib.sha256(repr((heads.config.feature_layers, heads.config.num_heads, teacher)).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode() + str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def conversation_key(backbone: str, example: dict) -> str:
    return hashlib.sha256((backbone + repr((example["input_ids"], example["labels"]))).encode()).hexdigest()


def stored(store: Path) -> dict[str, tuple[Path, int, int]]:
    """Every conversation in the store's readable parts: key -> (part, its first position there, its positions)."""
    found = {}
    for path in sorted(store.glob("part-*.safetensors")):
        found |= index(path)
    return found


def index(path: Path) -> dict[str, tuple[Path, int, int]]:
    """A part's conversations (stored's form); none where the part is unreadable (it is computed again, not trusted:
    a run killed while writing it leaves no such file, write_part writes aside, then renames)."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        keys, counts = json.loads(meta["keys"]), json.loads(meta["counts"])
    except Exception as error:  # noqa: BLE001 - a damaged part is computed again, not trusted
        logger.warning("states: %s is unreadable (%s); computing its conversations again", path, error)
        return {}
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return {key: (path, start, count) for key, start, count in zip(keys, starts, counts)}


def gather(found: dict[str, tuple[Path, int, int]], keys: list[str], teacher: bool) -> tuple[torch.Tensor | None, ...]:
    """The conversations' positions in `keys`' order (state, targets, path, ahead or None), read one part at a time
    into tensors made once: a run's states are gigabytes, and no part is held twice."""
    wanted = [found[key] for key in keys]
    total, out = sum(count for _, _, count in wanted), {}
    by_part: dict[Path, list[tuple[int, int, int]]] = {}
    at = 0
    for path, start, count in wanted:
        by_part.setdefault(path, []).append((at, start, count))
        at += count
    for path, pieces in by_part.items():
        with safe_open(str(path), "pt") as f:
            for name in FIELDS[: 4 if teacher else 3]:
                tensor = f.get_tensor(name)
                if name not in out:
                    out[name] = tensor.new_empty((total, *tensor.shape[1:]))
                for to, start, count in pieces:
                    out[name][to: to + count] = tensor[start: start + count]
    return tuple(out.get(name) for name in FIELDS)


def write_part(store: Path, keys: list[str], part: dict[str, torch.Tensor], counts: list[int]) -> Path:
    """Writes a part (aside, then renamed: whole or not at all) named by its conversations; returns its path."""
    store.mkdir(parents=True, exist_ok=True)
    path = store / f"part-{hashlib.sha256(''.join(keys).encode()).hexdigest()[:16]}.safetensors"
    aside = path.with_suffix(f".{os.getpid()}.tmp")  # processes of one run write the same part: each its own file
    save_file(part, str(aside), metadata={"keys": json.dumps(keys), "counts": json.dumps(counts)})
    os.replace(aside, path)
    return path
