"""The training objective: MedusaTrainingModel, whose forward is the loss, and the heads' loss it computes.

The hidden state at position t feeds the LM head, which predicts token t+1, and head k (0-based),
which predicts token t+k+2. Losses count only targets that are assistant tokens:

    MEDUSA-1  L_heads = sum_k decay^k CE(head k at t, x[t+k+2])     backbone frozen, no gradient through it
              (targets "teacher": CE to the frozen model's own distribution over x[t+k+2], its LM head at t+k+1)
    MEDUSA-2  L_LM + lambda * L_heads                               LoRA on every linear layer, lm_head included
              L_LM = KL(original || adapted) of the next-token distribution (self-distilled data; the
              original is the same network with its adapter disabled, no second copy) or CE to the data.
              lambda = lambda0, ramped up along a sine over the warm-up steps unless the heads start trained.

The losses are computed in the training model's forward, so that DDP/FSDP/DeepSpeed see one forward
pass; the Trainer (trainer.py) sets lambda.
"""

import itertools
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from ..config import TrainConfig
from ..heads import MedusaHeads, run_backbone
from .data import IGNORE_INDEX
from .positions import ahead_states, at_answers, future_labels, path_embeddings

OUTSIDE = -1  # a token's place where it is neither in the guess vocabulary (TrainConfig.guess_vocab) nor a target
TOPK_ACCURACY = 5
LOSS_CHUNK = 32  # positions whose head logits exist at once on a CPU: [K, LOSS_CHUNK, V] (the fastest chunk there)
GPU_LOSS_CHUNK = 1024  # on a GPU, where LOSS_CHUNK at a time made a step many small recomputed graphs


def heads_loss(heads: MedusaHeads, lm_head: nn.Module, state: torch.Tensor, targets: torch.Tensor, decay: float,
               embeds: torch.Tensor | None = None, ahead: torch.Tensor | None = None,
               counts: torch.Tensor | None = None):
    """state [N, S] (the heads' input states), targets [K, N] (embeds [N, K, H]: hydra heads' path; ahead [N, K, H]:
    the states whose `lm_head` distributions the heads learn instead of the target tokens, ahead_states) ->
    (sum_k decay^k mean CE_k, hits [N, K, 3]: top-1, top-5, has a target (the target tokens); None while training,
    when nothing reads them). counts [K]: the denominators of the means (default: these targets' own; a process of
    several passes the whole step's, target_counts).

    The heads run on a chunk of positions at a time, their logits recomputed in the backward pass: K x N x V logits
    at once cost gigabytes (an out-of-memory kill), and on a CPU most of a step went to faulting that
    memory in.
    """
    num_heads = heads.config.num_heads
    counts = (targets != IGNORE_INDEX).sum(-1) if counts is None else counts
    weights = decay ** torch.arange(num_heads, device=state.device) / counts.clamp(min=1)
    size = LOSS_CHUNK if state.device.type == "cpu" else GPU_LOSS_CHUNK
    split = [itertools.repeat(None) if x is None else x.split(size) for x in (embeds, ahead)]
    chunks = list(zip(state.split(size), targets.split(size, dim=1), *split))

    def chunk_loss(chunk_state, chunk_targets, chunk_embeds, chunk_ahead):
        logits = heads(chunk_state, lm_head, embeds=chunk_embeds)
        return weighted_ce(logits, chunk_targets, weights, teacher_probs(lm_head, chunk_ahead)), logits

    loss = state.new_zeros((), dtype=torch.float32)
    if torch.is_grad_enabled():
        recomputed = (checkpoint(lambda *c: chunk_loss(*c)[0], *chunk, use_reentrant=False) for chunk in chunks)
        return loss + sum(recomputed), None
    hits = [targets.new_zeros(num_heads, 0, 3)]  # [K, n, 3] per chunk, joined once
    for chunk in chunks:
        chunk_sum, logits = chunk_loss(*chunk)
        loss = loss + chunk_sum
        hits.append(head_hits(logits, chunk[1]))
    return loss, torch.cat(hits, 1).transpose(0, 1)


@torch.no_grad()
def teacher_probs(lm_head, ahead: torch.Tensor | None) -> torch.Tensor | None:
    """ahead [n, K, H] -> the frozen model's next-token distributions there [K, n, V] (float32); None: None."""
    return None if ahead is None else lm_head(ahead.transpose(0, 1)).float().softmax(-1)


def weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                teacher: torch.Tensor | None = None) -> torch.Tensor:
    """logits [K, n, V], targets [K, n] -> sum_k weights_k * CE of head k summed over the chunk: to the target tokens,
    or to `teacher` [K, n, V], the frozen model's distributions (teacher_probs), wherever there is a target."""
    if teacher is None:
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    else:
        losses = F.cross_entropy(logits.float().flatten(0, 1), teacher.flatten(0, 1), reduction="none")
        losses = losses.masked_fill(targets.flatten() == IGNORE_INDEX, 0)
    return (losses.view_as(targets).sum(-1) * weights).sum()


def head_hits(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [K, N, V], targets [K, N] -> [K, N, 3]: top-1 hit, top-5 hit, has a target (0/1 each)."""
    valid = targets != IGNORE_INDEX
    hit = logits.topk(min(TOPK_ACCURACY, logits.shape[-1]), dim=-1).indices == targets[..., None]
    return torch.stack([hit[..., 0] & valid, hit.any(-1) & valid, valid], dim=-1).long()


class MedusaTrainingModel(nn.Module):
    """Backbone (frozen, or a peft LoRA model) + heads; forward returns the loss, and per-head hits when evaluating.

    Its state dict holds only the trainable tensors: checkpoints stay small, and resuming restores
    exactly what training changes (the frozen rest is loaded with the model).
    """

    def __init__(self, backbone: nn.Module, heads: MedusaHeads, config: TrainConfig, vocab: torch.Tensor | None = None):
        """vocab: the guess vocabulary (data.answer_vocab) the heads' loss ranks, or None: all tokens."""
        super().__init__()
        self.backbone, self.heads, self.train_config = backbone, heads, config
        self.adapted = config.mode == "medusa2"
        self.vocab = vocab
        if vocab is not None:  # token id -> its place in vocab, OUTSIDE if none
            self.place = torch.full((heads.config.vocab_size,), OUTSIDE).index_copy_(0, vocab, torch.arange(len(vocab)))

    @property
    def causal_lm(self) -> PreTrainedModel:
        return self.backbone.get_base_model() if self.adapted else self.backbone

    def hidden_states(self, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] -> (last hidden states [B, T, H], the heads' input states [B, T, (1 + L) H]: heads.run_backbone)."""
        return run_backbone(self.causal_lm, self.heads.config.feature_layers, input_ids=input_ids,
                            attention_mask=attention_mask, use_cache=False)

    def forward(self, input_ids=None, attention_mask=None, labels=None, state=None, targets=None, path=None,
                ahead=None, heads_weight: float = 1.0, counts: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A batch of conversations (input_ids, attention_mask, labels [B, T]) or of answer positions whose states are
        cached (state [N, S], targets [N, K], path [N, K], and ahead [N, K, H] for targets "teacher": AnswerStates)
        -> the loss, and hits when evaluating: [B, K, 3] per conversation, [N, K, 3] per position. counts [K+1]: the
        means' denominators (target_counts; default: this batch's)."""
        num_heads, teacher = self.heads.config.num_heads, self.train_config.targets == "teacher"
        if state is None:
            with torch.set_grad_enabled(self.adapted and torch.is_grad_enabled()):
                hidden, states = self.hidden_states(input_ids, attention_mask)
            state, targets, path, rows = at_answers(states, input_ids, labels, num_heads)
            ahead = ahead_states(hidden, labels, num_heads) if teacher else None
        else:
            targets = targets.T
        lm_head = self.causal_lm.get_output_embeddings()
        ahead = None if ahead is None else ahead.to(lm_head.weight.dtype)
        embeds = path_embeddings(self.heads.config, self.causal_lm.get_input_embeddings(), path)
        projection = lm_head
        if self.vocab is not None:  # the guess vocabulary's rows and the batch's own targets beside them, gathered
            # once a step (the LM head is frozen): decoding guesses a row's own tokens beside the vocabulary
            # (heads.OwnTokens), so the heads learn to rank every answer token, not the vocabulary's alone
            vocab, place = self.vocab.to(targets.device), self.place.to(targets.device)
            extra = targets[targets != IGNORE_INDEX].unique()
            extra = extra[place[extra] == OUTSIDE]
            place = place.index_copy(0, extra, torch.arange(len(vocab), len(vocab) + len(extra), device=extra.device))
            projection = partial(F.linear, weight=lm_head.weight[torch.cat([vocab, extra])])
            targets = torch.where(targets == IGNORE_INDEX, IGNORE_INDEX, place[targets.clamp(min=0)])
        loss, hits = heads_loss(self.heads, projection, state, targets, self.train_config.decay, embeds, ahead,
                                None if counts is None else counts[:num_heads])
        loss = heads_weight * loss
        if self.adapted:
            loss = loss + self.lm_loss(lm_head, hidden, input_ids, attention_mask, labels,
                                       None if counts is None else counts[num_heads])
        if hits is not None and input_ids is not None:  # per conversation
            hits = hits.new_zeros(len(input_ids), num_heads, 3).index_add_(0, rows, hits)
        return {"loss": loss} if hits is None else {"loss": loss, "head_hits": hits}

    def lm_loss(self, lm_head, hidden, input_ids, attention_mask, labels, count=None) -> torch.Tensor:
        """MEDUSA-2's backbone term at every position whose next token is an answer token (count: the mean's
        denominator, default these positions')."""
        targets = future_labels(labels, 1)
        keep = targets != IGNORE_INDEX
        logits = lm_head(hidden[keep]).float()  # [N, V]
        count = (keep.sum() if count is None else count).clamp(min=1)
        if self.train_config.lm_loss == "ce":
            return F.cross_entropy(logits, targets[keep], reduction="sum") / count
        with torch.no_grad(), self.backbone.disable_adapter():
            original = lm_head(self.hidden_states(input_ids, attention_mask)[0][keep]).float()
        kl = F.kl_div(logits.log_softmax(-1), original.log_softmax(-1), log_target=True, reduction="sum")
        return kl / count

    def train(self, mode: bool = True) -> "MedusaTrainingModel":
        super().train(mode)
        if not self.adapted:
            self.backbone.eval()  # frozen: the heads see the hidden states of inference (no dropout)
        return self

    def trainable_names(self) -> set[str]:
        return {name for name, p in self.named_parameters() if p.requires_grad}

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False):
        trainable = {prefix + name for name in self.trainable_names()}
        everything = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        destination = {} if destination is None else destination
        destination.update((k, v) for k, v in everything.items() if k in trainable)
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k in self.trainable_names()]
        if strict and (missing or result.unexpected_keys):
            raise ValueError(f"checkpoint does not match the model: missing {missing[:4]}, "
                             f"unexpected {result.unexpected_keys[:4]}")
        return type(result)(missing, result.unexpected_keys)
