"""Does head 0 of trained hydra heads guess better when it also reads earlier layers (EAGLE-3's fused features), or
when it also regresses the base model's next hidden state (EAGLE's feature loss)?

A probe, not a training recipe: the frozen base model's features at every answer position of the training and
calibration files are cached once (bfloat16), then head 0 of HEADS_DIR is trained further twice with the same
batches, schedule and seed: as it is (`[h; e(root)]`, the shipped layout) and reading layers' outputs beside them
(RMS-normalised without weights, their columns zero at the start so both variants start from the same logits); with
`--regress W`, a third time as it is, its loss plus W times the smooth L1 distance between its state (what the LM
head projects) and h_t+1, the base model's state whose projection is the distribution of token t+2. Its
rank-0 accuracy on the calibration files (never trained on) is printed after every epoch, over the guess vocabulary
that the heads' calibration recorded, as the calibration counts it. Prints a table, writes JSON and a PNG beside it.
usage: .venv/bin/python benchmarks/feature_probe.py --train FILE [FILE ...] --heldout FILE [FILE ...] --json PATH
           [--heads DIR] [--layers 8 16 24] [--epochs 2] [--lr 5e-4] [--regress W]
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from medusa_decoding.base import load_base
from medusa_decoding.embedded import shipped_heads
from medusa_decoding.heads import MedusaHeads, run_backbone
from medusa_decoding.training.data import IGNORE_INDEX, build_examples, collate, read_conversations
from medusa_decoding.training.positions import at_answers

BATCH = 256


def features(model, tokenizer, files: list[str], layers: list[int]) -> dict[str, torch.Tensor]:
    """At every position t whose token t+2 is an answer token: h_t [N, H], the layers' outputs at t [N, L, H]
    (RMS-normalised), h_t+1 [N, H], the root x_t+1 and the target x_t+2 [N]: as training reads them (at_answers,
    for one hydra head that reads the layers), a conversation at a time."""
    examples = build_examples(tokenizer, [chat for path in files for chat in read_conversations(path)], 2048)
    size = model.config.hidden_size
    found = {"hidden": [], "layers": [], "next": [], "root": [], "target": []}
    with torch.no_grad():
        for example in tqdm(examples, desc=f"features of {len(examples)} conversations", unit="conversation"):
            batch = collate([example], pad_id=0)
            hidden, state = run_backbone(model, tuple(layers), input_ids=batch["input_ids"],
                                         attention_mask=batch["attention_mask"])
            following = torch.cat([hidden[:, 1:], hidden[:, -1:] * 0], 1)  # h_t+1 (the last t is no answer's)
            state, targets, path, _ = at_answers(torch.cat([state, following], -1), batch["input_ids"],
                                                 batch["labels"], 1)
            found["hidden"].append(state[:, :size].bfloat16())
            found["layers"].append(state[:, size:-size].unflatten(-1, (len(layers), size)).bfloat16())
            found["next"].append(state[:, -size:].bfloat16())
            found["root"].append(path[:, 0])
            found["target"].append(targets[0])
    return {name: torch.cat(parts) for name, parts in found.items()}


class Head0(torch.nn.Module):
    """Head 0 of hydra heads, optionally reading `extra` more feature vectors: h + SiLU(W [h; e(root); layers])
    projected onto the guess vocabulary's rows of the LM head."""

    def __init__(self, heads: MedusaHeads, rows: torch.Tensor, embed: torch.Tensor, extra: int):
        super().__init__()
        linear = heads.heads[0][0].linear
        hidden = linear.weight.shape[0]
        self.weight = torch.nn.Parameter(
            torch.cat([linear.weight.float(), linear.weight.new_zeros(hidden, extra * hidden).float()], 1))
        self.bias = torch.nn.Parameter(linear.bias.float().clone())
        self.rows, self.embed, self.extra = rows, embed, extra

    def state(self, data: dict, index: torch.Tensor) -> torch.Tensor:
        h = data["hidden"][index].float()
        inputs = [h, self.embed[data["root"][index]]]
        if self.extra:
            inputs.append(data["layers"][index].float().flatten(1))
        return h + F.silu(F.linear(torch.cat(inputs, 1), self.weight, self.bias))

    def forward(self, data: dict, index: torch.Tensor) -> torch.Tensor:
        return self.state(data, index) @ self.rows.T


@torch.no_grad()
def accuracy(head: Head0, data: dict, vocab: torch.Tensor) -> float:
    hits = sum((vocab[head(data, index).argmax(-1)] == data["target"][index]).sum().item()
               for index in torch.arange(len(data["target"])).split(4096))
    return hits / len(data["target"])


def train(head: Head0, data: dict, heldout: dict, vocab: torch.Tensor, epochs: int, lr: float, regress: float = 0.0
          ) -> list[float]:
    """AdamW, 20 warm-up steps, cosine decay; the same batches for every variant (regress: the weight of the smooth
    L1 distance to h_t+1 beside the cross-entropy). Returns held-out accuracy before training and after each epoch."""
    place = torch.full((head.embed.shape[0],), IGNORE_INDEX).index_copy_(0, vocab, torch.arange(len(vocab)))
    targets = place[data["target"]]
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    steps, step, curve = epochs * math.ceil(len(targets) / BATCH), 0, [accuracy(head, heldout, vocab)]
    for epoch in range(epochs):
        for index in tqdm(torch.randperm(len(targets), generator=generator).split(BATCH), desc=f"epoch {epoch}",
                          leave=False):
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
            state = head.state(data, index)
            loss = F.cross_entropy(state @ head.rows.T, targets[index], ignore_index=IGNORE_INDEX)
            if regress:
                loss = loss + regress * F.smooth_l1_loss(state, data["next"][index].float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
        curve.append(accuracy(head, heldout, vocab))
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", nargs="+", required=True)
    parser.add_argument("--heldout", nargs="+", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--heads", type=Path, default=shipped_heads())
    parser.add_argument("--layers", nargs="+", type=int, default=[8, 16, 24])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--regress", type=float, default=0.0, help="also train a variant that regresses h_t+1")
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_base(None, torch.bfloat16)
    heads = MedusaHeads.from_pretrained(args.heads)
    if heads.config.kind != "hydra":
        raise SystemExit(f"{args.heads}: MEDUSA heads; the probe extends a hydra head")
    vocab = torch.tensor(json.loads((args.heads / "accuracy.json").read_text())["guess_vocab"])
    weights = model.get_output_embeddings().weight.detach().float()
    rows, embed = weights[vocab], model.get_input_embeddings().weight.detach().float()
    heldout = features(model, tokenizer, args.heldout, args.layers)
    data = features(model, tokenizer, args.train, args.layers)
    results = {"heads": str(args.heads), "layers": args.layers, "epochs": args.epochs, "lr": args.lr,
               "regress": args.regress, "train_positions": len(data["target"]),
               "heldout_positions": len(heldout["target"]), "variants": {}}
    variants = [("tokens (shipped layout)", 0, 0.0), (f"tokens + layers {args.layers}", len(args.layers), 0.0)]
    if args.regress:
        variants.append((f"tokens, regressing h_t+1 (x{args.regress:g})", 0, args.regress))
    for name, extra, regress in variants:
        start = time.perf_counter()
        curve = train(Head0(heads, rows, embed, extra), data, heldout, vocab, args.epochs, args.lr, regress)
        results["variants"][name] = {"heldout_top1": curve, "seconds": time.perf_counter() - start}
    print(f"{'head 0':<40}" + "".join(f"{'epoch ' + str(e):>10}" for e in range(args.epochs + 1)))
    for name, result in results["variants"].items():
        print(f"{name:<40}" + "".join(f"{a:>10.4f}" for a in result["heldout_top1"]))
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    plot(results, Path(args.json).with_suffix(".png"))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, result in results["variants"].items():
        axes.plot(range(len(result["heldout_top1"])), result["heldout_top1"], marker="o", label=name)
    axes.set_xlabel(f"epochs over {results['train_positions']} answer positions (lr {results['lr']}, cosine)")
    axes.set_ylabel(f"head 0 top-1, {results['heldout_positions']} held-out positions")
    axes.set_title(f"head 0 of the hydra heads in {Path(results['heads']).name}/, trained further")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
