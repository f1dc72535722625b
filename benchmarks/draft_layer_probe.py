"""Does a decoder layer over the prefix (EAGLE's draft model, Hydra++'s prefix attention) lift head 0 of the hydra
heads, given the data and epochs a GPU trains on in minutes?

Head 0 of the hydra heads guesses token t+2 from h_t and the root's embedding e(x_t+1): one MLP, no look at the
prefix beyond what h_t holds. The variants add one causal decoder layer over the fused inputs [h_i; e(x_i+1)] of
every position up to t (what EAGLE's draft model reads), its weights copied from the base model's last layer and its
output projections zeroed, so that every variant starts from the shipped head's logits. Same conversation batches,
schedule and seed for all; held-out top-1 over the guess vocabulary (the heads' calibration's) after every epoch,
beside the ceiling: the base model's own argmax at t+1, what a perfect draft of the base model would guess.
Variants: the MLP alone (trained further), + the layer, + the layer at a fifth of the learning rate, + the layer on
the teacher's distribution (Hydra++'s target: softmax of the base model's logits at t+1, over the guess vocabulary),
+ the layer on half the conversations.
Prints a table, writes JSON (after every variant) and a PNG beside it, and with --heads-out the heads of every layer
variant run (the given heads, head 0 and the prefix layer trained) in a directory named after the variant.
--bf16 trains under bfloat16 autocast (a CPU with AVX-512 BF16 or AMX: 2.4x faster a batch than float32).
usage: python benchmarks/draft_layer_probe.py --train FILE [FILE ...] --heldout FILE [FILE ...] --json PATH
           [--heads DIR] [--epochs 8] [--lr 5e-4] [--batch-tokens 8192] [--limit N] [--device cuda] [--bf16]
           [--variants mlp layer layer-lr5 teacher half] [--heads-out DIR]
"""

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_decoding.calibrate import device_name
from medusa_decoding.default_model import shipped_heads
from medusa_decoding.heads import MedusaHeads, run_backbone
from medusa_decoding.base import load_base
from medusa_decoding.training.data import IGNORE_INDEX, build_examples, collate, read_conversations
from medusa_decoding.training.positions import future_labels
from medusa_decoding.training.train import prefix_shape, with_prefix

WARMUP = 20
# key: (name, with the layer, teacher's distribution as target, the layer's lr scale, every n-th conversation)
VARIANTS = {"mlp": ("MLP (the shipped head 0)", False, False, 1.0, 1),
            "layer": ("MLP + decoder layer", True, False, 1.0, 1),
            "layer-lr5": ("MLP + decoder layer at lr / 5", True, False, 0.2, 1),
            "teacher": ("MLP + decoder layer, teacher's distribution", True, True, 1.0, 1),
            "half": ("MLP + decoder layer, half the conversations", True, False, 1.0, 2)}


def features(model, tokenizer, files: list[str], limit: int | None, batch_size: int = 16) -> list[dict]:
    """Per conversation (the frozen model, teacher-forced): h [T, H] (bfloat16), ids [T], target [T] = the answer
    token two ahead (IGNORE_INDEX elsewhere). Kept on the model's device."""
    examples = build_examples(tokenizer, [chat for path in files for chat in read_conversations(path)], 2048)
    examples = sorted(examples[:limit], key=lambda e: len(e["input_ids"]))
    found = []
    with torch.no_grad():
        for start in tqdm(range(0, len(examples), batch_size), desc=f"features of {len(examples)} conversations"):
            group = examples[start: start + batch_size]
            batch = {k: v.to(model.device) for k, v in collate(group, pad_id=0).items()}
            hidden, _ = run_backbone(model, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            target = future_labels(batch["labels"], 2)
            for row, example in enumerate(group):
                size = len(example["input_ids"])
                found.append({"h": hidden[row, :size].bfloat16(), "ids": batch["input_ids"][row, :size],
                              "target": target[row, :size]})
    return found


def batches(data: list[dict], tokens: int) -> list[list[int]]:
    """Consecutive conversations (sorted by length) up to `tokens` padded tokens a batch."""
    groups, group = [], []
    for i, example in enumerate(data):
        if group and (len(group) + 1) * len(example["ids"]) > tokens:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group]


def padded(data: list[dict], group: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [B, T, H] float, ids [B, T], target [B, T] of a batch, right-padded (causal attention never reads padding)."""
    width = max(len(data[i]["ids"]) for i in group)

    def stack(name: str, value) -> torch.Tensor:
        return torch.stack([F.pad(data[i][name], (0, 0, 0, width - len(data[i][name])) if name == "h" else
                                  (0, width - len(data[i][name])), value=value) for i in group])

    return stack("h", 0.0).float(), stack("ids", 0), stack("target", IGNORE_INDEX)


class DraftHead(torch.nn.Module):
    """Head 0 of hydra heads, h + SiLU(W [h; e(root)] + b), plus (with `layer`) their prefix layer (heads.PrefixLayer,
    the base model's last layer copied, its output at zero: train.with_prefix), whose output it adds: projected onto
    the guess vocabulary's LM rows. `heads`: the whole heads, saved as such (the other heads untouched)."""

    def __init__(self, heads: MedusaHeads, base, rows: torch.Tensor, embed: torch.Tensor, layer: bool):
        super().__init__()
        self.heads = copy.deepcopy(with_prefix(heads, base, prefix_shape(base)) if layer else heads).float()
        self.rows, self.embed, self.layer = rows, embed, layer
        self.mlp = list(self.heads.heads[0][0].parameters())

    def forward(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """h [B, T, H], ids [B, T] -> head 0's state at every t [B, T, H] (root: x_t+1; the last t has none)."""
        root = self.embed[torch.cat([ids[:, 1:], ids[:, -1:]], 1)]
        state = self.heads.heads[0][0](h, root[..., None, :])
        return state + self.heads.prefix(h, root) if self.layer else state


def targets_in(vocab: torch.Tensor, size: int) -> torch.Tensor:
    """token id -> its column among the guess rows, IGNORE_INDEX where it is not one."""
    return torch.full((size,), IGNORE_INDEX, device=vocab.device).index_copy_(
        0, vocab, torch.arange(len(vocab), device=vocab.device))


@torch.no_grad()
def accuracy(head: DraftHead, data: list[dict], groups: list[list[int]], vocab: torch.Tensor) -> float:
    hits = total = 0
    for group in groups:
        h, ids, target = padded(data, group)
        keep = target != IGNORE_INDEX
        hits += (vocab[(head(h, ids)[keep] @ head.rows.T).argmax(-1)] == target[keep]).sum().item()
        total += keep.sum().item()
    return hits / total


@torch.no_grad()
def ceiling(base, data: list[dict], groups: list[list[int]]) -> float:
    """The base model's argmax at t+1 (the full vocabulary) against the answer token at t+2."""
    hits = total = 0
    for group in groups:
        h, _, target = padded(data, group)
        keep = target[:, :-1] != IGNORE_INDEX
        guess = base.lm_head(h[:, 1:][keep].to(base.lm_head.weight.dtype)).argmax(-1)
        hits += (guess == target[:, :-1][keep]).sum().item()
        total += keep.sum().item()
    return hits / total


def train(head: DraftHead, data: list[dict], heldout: tuple, vocab: torch.Tensor, args, teacher: bool,
          layer_lr: float) -> list[float]:
    """AdamW, warm-up then cosine decay (the layer's parameters at layer_lr times the MLP's), batches in a seeded
    order. Loss: cross-entropy to the answer token among
    the guess rows, or (teacher) to softmax of the base model's logits at t+1 over them. Returns held-out top-1
    before training and after every epoch."""
    place = targets_in(vocab, head.embed.shape[0])
    groups = batches(data, args.batch_tokens)
    mlp, layer = head.mlp, list(head.heads.prefix.parameters()) if head.layer else []
    optimizer = torch.optim.AdamW([{"params": mlp, "scale": 1.0}, {"params": layer, "scale": layer_lr}],
                                  weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    steps, step, curve = args.epochs * len(groups), 0, [accuracy(head, *heldout, vocab)]
    for epoch in range(args.epochs):
        for g in tqdm(torch.randperm(len(groups), generator=generator).tolist(), desc=f"epoch {epoch}", leave=False):
            for group in optimizer.param_groups:
                group["lr"] = group["scale"] * args.lr * min(1, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * step / steps))
            h, ids, target = padded(data, groups[g])
            keep = target != IGNORE_INDEX
            with torch.autocast(h.device.type, torch.bfloat16, enabled=args.bf16):
                logits = (head(h, ids)[keep] @ head.rows.T).float()
                if teacher:
                    soft = (torch.cat([h[:, 1:], h[:, -1:]], 1)[keep] @ head.rows.T).float().softmax(-1)
                    loss = F.cross_entropy(logits, soft)
                else:
                    loss = F.cross_entropy(logits, place[target[keep]], ignore_index=IGNORE_INDEX)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        curve.append(accuracy(head, *heldout, vocab))
        print(f"  epoch {epoch}: held-out top-1 {curve[-1]:.4f}", flush=True)
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", nargs="+", required=True)
    parser.add_argument("--heldout", nargs="+", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--heads", type=Path, default=shipped_heads())
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--limit", type=int, default=None, help="conversations per file list (a rehearsal)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="train under bfloat16 autocast")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--heads-out", type=Path, help="write the heads of every layer variant run to DIR/VARIANT "
                                                       "(bfloat16, as shipped; `medusa calibrate` them next)")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    start = time.perf_counter()
    base, tokenizer = load_base(None, torch.bfloat16, device=args.device)
    heads = MedusaHeads.from_pretrained(args.heads)
    if heads.config.kind != "hydra":
        raise SystemExit(f"{args.heads}: MEDUSA heads; the probe extends a hydra head")
    vocab = torch.tensor(json.loads((args.heads / "accuracy.json").read_text())["guess_vocab"], device=args.device)
    rows = base.get_output_embeddings().weight.detach().float()[vocab]
    embed = base.get_input_embeddings().weight.detach().float()
    heldout_data = features(base, tokenizer, args.heldout, args.limit)
    data = features(base, tokenizer, args.train, args.limit)
    heldout = (heldout_data, batches(heldout_data, args.batch_tokens))
    json_path = Path(args.json)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    results = {"heads": str(args.heads), "epochs": args.epochs, "lr": args.lr, "batch_tokens": args.batch_tokens,
               "bf16": args.bf16,
               "device": device_name(torch.device(args.device)),
               "train_conversations": len(data),
               "train_positions": sum((e["target"] != IGNORE_INDEX).sum().item() for e in data),
               "heldout_positions": sum((e["target"] != IGNORE_INDEX).sum().item() for e in heldout_data),
               "ceiling_base_argmax": ceiling(base, *heldout), "features_seconds": time.perf_counter() - start,
               "variants": {}}
    print(f"ceiling (the base model's argmax at t+1): {results['ceiling_base_argmax']:.4f}", flush=True)
    for key in args.variants:
        name, layer, teacher, layer_lr, every = VARIANTS[key]
        print(name, flush=True)
        began = time.perf_counter()
        subset = data[::every]
        head = DraftHead(heads, base, rows, embed, layer).to(args.device)
        curve = train(head, subset, heldout, vocab, args, teacher, layer_lr)
        results["variants"][name] = {"heldout_top1": curve, "seconds": time.perf_counter() - began,
                                     "train_positions": sum((e["target"] != IGNORE_INDEX).sum().item() for e in subset)}
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        if layer and args.heads_out:
            head.heads.to(torch.bfloat16).save_pretrained(args.heads_out / key)
    print(f"{'head 0, held-out top-1':<48}" + "".join(f"{'epoch ' + str(e):>9}" for e in range(args.epochs + 1)))
    for name, result in results["variants"].items():
        print(f"{name:<48}" + "".join(f"{a:>9.4f}" for a in result["heldout_top1"]))
    plot(results, json_path.with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    for name, result in results["variants"].items():
        axes.plot(range(len(result["heldout_top1"])), result["heldout_top1"], marker="o", label=name)
    axes.axhline(results["ceiling_base_argmax"], color="grey", linestyle="--", label="the base model's own argmax")
    axes.set_xlabel(f"epochs over up to {results['train_positions']} answer positions (lr {results['lr']}, cosine)")
    axes.set_ylabel(f"head 0 top-1, {results['heldout_positions']} held-out positions")
    axes.set_title(f"head 0 with a decoder layer over the prefix ({results['device']})")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
