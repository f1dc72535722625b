"""The answer positions heads train on, and what they read there: each head's target, the tokens that hydra heads read
of the path, the frozen model's states ahead (teacher targets). Training and calibration read the heads' inputs
through here alike."""

from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ..config import HeadsConfig
from ..heads import MedusaHeads, run_backbone
from .data import IGNORE_INDEX, collate

HEAD_OFFSET = 2  # head k predicts the token k + HEAD_OFFSET ahead; the LM head predicts 1 ahead


def future_labels(labels: torch.Tensor, offset: int) -> torch.Tensor:
    """labels [B, T] -> the label `offset` positions ahead of each position [B, T]; IGNORE_INDEX past the end."""
    return torch.cat([labels[:, offset:], labels.new_full((labels.shape[0], offset), IGNORE_INDEX)], dim=1)


def path_tokens(input_ids: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What hydra heads read of the tokens after each position t, teacher-forced: input_ids [B, T] -> [B, T, K], tokens
    t+1..t+K (head k reads the first k+1; past the end the last token, where no head has a target)."""
    last = input_ids[:, -1:]
    return torch.stack([torch.cat([input_ids[:, j:], last.expand(-1, j)], dim=1) for j in range(1, num_heads + 1)], -1)


def path_embeddings(config: HeadsConfig, embed: nn.Module, path: torch.Tensor) -> torch.Tensor | None:
    """What hydra heads read of the tokens after t: path [N, K] (path_tokens) -> their input embeddings [N, K, H];
    None for MEDUSA heads, which read h_t alone."""
    return embed(path) if config.kind == "hydra" else None


def answer_mask(labels: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [B, T] -> (each head's target [K, B, T], the positions where some head has one [B, T])."""
    targets = torch.stack([future_labels(labels, k + HEAD_OFFSET) for k in range(num_heads)])
    return targets, (targets != IGNORE_INDEX).any(0)


def at_answers(state: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor, num_heads: int):
    """The positions where some head has a target, out of a batch of conversations: state [B, T, S], input_ids and
    labels [B, T] -> (state [n, S], targets [K, n], path [n, K]: path_tokens, rows [n]: each position's example).
    Only these positions are trained on, so prompts and padding cost the heads nothing."""
    targets, keep = answer_mask(labels, num_heads)
    return state[keep], targets[:, keep], path_tokens(input_ids, num_heads)[keep], keep.nonzero()[:, 0]


def ahead_states(hidden: torch.Tensor, labels: torch.Tensor, num_heads: int) -> torch.Tensor:
    """The last hidden states [n, K, H] at t+1..t+K of at_answers' positions t (hidden [B, T, H]): the frozen model's
    LM head at t+k+1 gives its distribution over head k's target (targets "teacher"). Past the end: the last state,
    where no head has a target."""
    b, t = answer_mask(labels, num_heads)[1].nonzero(as_tuple=True)
    later = (t[:, None] + torch.arange(1, num_heads + 1, device=t.device)).clamp(max=hidden.shape[1] - 1)
    return hidden[b[:, None], later]


@torch.no_grad()
def answer_positions(model: PreTrainedModel, heads: MedusaHeads, examples: list[dict], pad_id: int,
                     batch_size: int, teacher: bool = False) -> Iterator[tuple[torch.Tensor, ...]]:
    """The frozen model's answer positions in `examples`, teacher-forced, a batch of examples at a time: (the heads'
    input state [n, S] (heads.run_backbone), targets [K, n], path [n, K]), as at_answers gives them, and with
    `teacher` the states ahead [n, K, H] (ahead_states). Calibration and AnswerStates read the heads' inputs through
    here."""
    num_heads = heads.config.num_heads
    for start in range(0, len(examples), batch_size):
        batch = {k: v.to(model.device) for k, v in collate(examples[start: start + batch_size], pad_id).items()}
        hidden, state = run_backbone(model, heads.config.feature_layers, input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"])
        found = at_answers(state, batch["input_ids"], batch["labels"], num_heads)[:3]
        yield found + (ahead_states(hidden, batch["labels"], num_heads),) if teacher else found
