"""Head training on the Hugging Face `Trainer`: one process, or several under torchrun or accelerate (docs/training.md).

The hidden state at position t feeds the LM head, which predicts token t+1, and head k (0-based),
which predicts token t+k+2. Losses count only targets that are assistant tokens:

    MEDUSA-1  L_heads = sum_k decay^k CE(head k at t, x[t+k+2])     backbone frozen, no gradient through it
              (targets "teacher": CE to the frozen model's own distribution over x[t+k+2], its LM head at t+k+1)
    MEDUSA-2  L_LM + lambda * L_heads                               LoRA on every linear layer, lm_head included
              L_LM = KL(original || adapted) of the next-token distribution (self-distilled data; the
              original is the same network with its adapter disabled, no second copy) or CE to the data.
              lambda = lambda0, ramped up along a sine over the warm-up steps unless the heads start trained.

The losses are computed in the training model's forward, so that DDP/FSDP/DeepSpeed see one forward
pass; `MedusaTrainer.compute_loss` sets lambda, `create_optimizer` gives the heads their learning rate.

MEDUSA-1 trains on batches of conversations, or (position_batch) on batches of answer positions whose states the
frozen backbone computed once (AnswerStates): the same loss, with the backbone's cost paid once instead of every
epoch, and many more updates an epoch.
"""

import importlib.util
import itertools
import json
import math
import os
import shutil
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import EvalPrediction, PreTrainedModel, Trainer, TrainingArguments, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import HeadsConfig, TrainConfig
from ..heads import MedusaHeads, run_backbone
from ..base import load_base, untie_output_embeddings
from ..formats import ADAPTER_DIR, MERGED_DIR, TRAIN_ACCURACY_NAME, TRAIN_CONFIG_NAME
from .data import IGNORE_INDEX, answer_vocab, build_examples, collate, split
from .positions import HEAD_OFFSET, ahead_states, answer_mask, at_answers, future_labels, path_embeddings
from .states import AnswerStates, backbone_key

OUTSIDE = -1  # a token's place where it is neither in the guess vocabulary (TrainConfig.guess_vocab) nor a target
TOPK_ACCURACY = 5
LOSS_CHUNK = 32  # positions whose head logits exist at once on a CPU: [K, 32, V], 25 MB for SmolLM2 (fastest there)
GPU_LOSS_CHUNK = 1024  # on a GPU, where 32 at a time made a step of 1024 positions some 100 small recomputed graphs
CHECKPOINTS = "checkpoints"
STATES = "states"  # position_batch: the backbone's states, kept in parts until the run ends (states.AnswerStates)
TRAINER_STATE = "trainer_state.json"  # the last file the Trainer writes into a checkpoint


def heads_loss(heads: MedusaHeads, lm_head: nn.Module, state: torch.Tensor, targets: torch.Tensor, decay: float,
               embeds: torch.Tensor | None = None, ahead: torch.Tensor | None = None,
               counts: torch.Tensor | None = None):
    """state [N, S] (the heads' input states), targets [K, N] (embeds [N, K, H]: hydra heads' path; ahead [N, K, H]:
    the states whose `lm_head` distributions the heads learn instead of the target tokens, ahead_states) ->
    (sum_k decay^k mean CE_k, hits [N, K, 3]: top-1, top-5, has a target (the target tokens); None while training,
    when nothing reads them). counts [K]: the denominators of the means (default: these targets' own; a process of
    several passes the whole step's, target_counts).

    The heads run on a chunk of positions at a time, their logits recomputed in the backward pass: K x N x V logits
    at once cost gigabytes (an out-of-memory kill at 24 GiB), and on a CPU most of a step went to faulting that
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
        return loss + sum(checkpoint(lambda *c: chunk_loss(*c)[0], *chunk, use_reentrant=False) for chunk in chunks), None
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


def heads_weight(config: TrainConfig, step: int, ramp: bool) -> float:
    """The heads' loss weight: 1 (MEDUSA-1); lambda0, sine-ramped over the warm-up steps when ramp (MEDUSA-2)."""
    if config.mode == "medusa1":
        return 1.0
    if not ramp or config.warmup_steps == 0:
        return config.lambda0
    return config.lambda0 * math.sin(math.pi / 2 * min(1.0, step / config.warmup_steps))


class MedusaTrainer(Trainer):
    """compute_loss weighs the heads' term (MEDUSA-2's lambda); create_optimizer gives heads their own LR."""

    def __init__(self, *args, medusa: TrainConfig, ramp: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.medusa, self.ramp = medusa, ramp

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Means over the targets of every process's batch: each process divides its sums by the step's counts, and
        its loss is scaled by the processes' number, which DDP's gradient average divides out again. Several
        processes then give one process's gradients for the same global batch (within float rounding)."""
        counts = self.accelerator.reduce(target_counts(inputs, self.medusa.num_heads), "sum")
        outputs = model(**inputs, heads_weight=heads_weight(self.medusa, self.state.global_step, self.ramp),
                        counts=counts)
        loss = outputs["loss"] * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            wrapper = self.model
            backbone = [p for p in wrapper.backbone.parameters() if p.requires_grad]
            groups = [{"params": list(wrapper.heads.parameters())}]
            if backbone:
                groups.append({"params": backbone, "lr": self.args.learning_rate / self.medusa.heads_lr_ratio})
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, wrapper)
            self.optimizer = optimizer_cls(groups, **kwargs)
        return self.optimizer


def target_counts(inputs: dict, num_heads: int) -> torch.Tensor:
    """A batch's targets [K+1]: each head's, then the LM head's (MEDUSA-2's backbone term), counted as the losses
    count them; from labels [B, T] (conversations) or targets [N, K] (answer positions, which have no LM term)."""
    if "targets" in inputs:
        heads = (inputs["targets"] != IGNORE_INDEX).sum(0)
        return torch.cat([heads, heads.new_zeros(1)])
    labels = inputs["labels"]
    heads = (answer_mask(labels, num_heads)[0] != IGNORE_INDEX).sum((1, 2))
    return torch.cat([heads, (future_labels(labels, 1) != IGNORE_INDEX).sum()[None]])


def head_metrics(prediction: EvalPrediction, num_heads: int) -> dict[str, float]:
    """Per-head top-1 / top-5 accuracy from the hit counts [examples, K, 3] of the eval set."""
    hits = prediction.predictions.reshape(-1, num_heads, 3).sum(0)
    metrics = {}
    for k, (top1, top5, count) in enumerate(hits.tolist()):
        metrics |= {f"head{k}_top1": top1 / max(count, 1), f"head{k}_top5": top5 / max(count, 1), f"head{k}_tokens": count}
    return metrics


def load_backbone(model: str | None, config: TrainConfig):
    """The base model and tokenizer, in bf16 if asked, the frozen MEDUSA-1 backbone quantized if asked; on this
    process's GPU where there is one: position_batch computes the states before the Trainer would move it there."""
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    if config.quantize is None:
        return load_base(model, dtype, device=device)
    if device is None or importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError(f"quantize={config.quantize!r} needs a CUDA GPU and the bitsandbytes package "
                         "(pip install bitsandbytes)")
    from transformers import BitsAndBytesConfig

    bits = BitsAndBytesConfig(load_in_8bit=config.quantize == "8bit", load_in_4bit=config.quantize == "4bit",
                              bnb_4bit_compute_dtype=dtype)
    return load_base(model, dtype, quantization_config=bits, device_map={"": device})


def make_heads(model: PreTrainedModel, config: TrainConfig, init_heads: str | Path | None) -> MedusaHeads:
    """Fresh heads (an untrained head repeats the base model), or trained ones to start from; fp32 to train.
    Trained MEDUSA heads start hydra heads too (`with_tokens`): they train only what the tokens add; trained heads
    start deeper ones (`deepened`) and ones that read feature layers (`with_features`): they train only what the new
    blocks and inputs add."""
    hidden_size = model.config.get_text_config().hidden_size
    lm_head = model.get_output_embeddings()
    vocab_size = lm_head.weight.shape[0]
    wanted = HeadsConfig(hidden_size, vocab_size, config.num_heads, config.num_layers, config.projection,
                         model.name_or_path, config.kind, config.feature_layers)
    num_layers = model.config.get_text_config().num_hidden_layers
    if init_heads is None:
        heads = MedusaHeads(wanted, lm_head)
    else:
        heads = MedusaHeads.from_pretrained(init_heads, vocab_size=vocab_size)
        heads.check_compatible(hidden_size, vocab_size, model.name_or_path)  # another model's: say so first
        if (heads.config.kind, wanted.kind) == ("medusa", "hydra"):
            heads = with_tokens(heads)
        if heads.config.num_layers < wanted.num_layers:
            heads = deepened(heads, wanted.num_layers)
        if not heads.config.feature_layers and wanted.feature_layers:
            heads = with_features(heads, wanted.feature_layers)
        for name in ("kind", "num_heads", "num_layers", "projection", "feature_layers"):
            if getattr(heads.config, name) != getattr(wanted, name):
                raise ValueError(f"init heads {init_heads} have {name}={getattr(heads.config, name)!r}, "
                                 f"but training asks for {name}={getattr(wanted, name)!r}")
    heads.check_compatible(hidden_size, vocab_size, model.name_or_path, num_layers)  # feature layers within the model
    return heads.float()


def with_tokens(heads: MedusaHeads) -> MedusaHeads:
    """MEDUSA heads as hydra heads that give the same logits: each first block reads the tokens too, through zero
    weights."""
    hydra = MedusaHeads(replace(heads.config, kind="hydra"))
    state = heads.state_dict()
    for k in range(heads.config.num_heads):
        name = f"heads.{k}.0.linear.weight"
        state[name] = torch.cat([state[name], state[name].new_zeros(state[name].shape[0], (k + 1) * state[name].shape[1])], 1)
    hydra.load_state_dict(state)
    return hydra


def with_features(heads: MedusaHeads, layers: tuple[int, ...]) -> MedusaHeads:
    """Heads that read the outputs of `layers` too and give the same logits: each first block reads them, between h
    and the tokens, through zero weights."""
    fused = MedusaHeads(replace(heads.config, feature_layers=layers))
    state, size = heads.state_dict(), heads.config.hidden_size
    for k in range(heads.config.num_heads):
        weight = state[f"heads.{k}.0.linear.weight"]
        state[f"heads.{k}.0.linear.weight"] = torch.cat([weight[:, :size], weight.new_zeros(size, len(layers) * size),
                                                         weight[:, size:]], 1)
    fused.load_state_dict(state)
    return fused


def deepened(heads: MedusaHeads, num_layers: int) -> MedusaHeads:
    """Heads with num_layers blocks that give the same logits: the new blocks follow the trained ones, zero-initialised
    (the identity), and an own projection moves past them."""
    deeper = MedusaHeads(replace(heads.config, num_layers=num_layers))
    state, old = deeper.state_dict(), heads.config.num_layers
    for name, tensor in heads.state_dict().items():
        _, k, layer, rest = name.split(".", 3)  # heads.{k}.{layer}.{rest}
        state[f"heads.{k}.{int(layer) if int(layer) < old else int(layer) - old + num_layers}.{rest}"] = tensor
    deeper.load_state_dict(state)
    return deeper


def prepare_backbone(model: PreTrainedModel, config: TrainConfig) -> nn.Module:
    """MEDUSA-1: the model, frozen. MEDUSA-2: a peft LoRA model on every linear layer, lm_head included."""
    model.requires_grad_(False)
    if config.mode == "medusa1":
        return model
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    untie_output_embeddings(model)
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))})
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      target_modules=linear, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def training_arguments(output: Path, config: TrainConfig, evaluate: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output / CHECKPOINTS),
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.position_batch or config.batch_size,
        per_device_eval_batch_size=config.position_batch or config.batch_size,
        # batches of conversations of similar lengths: padding was 60% of the tokens
        train_sampling_strategy="random" if config.position_batch else "group_by_length",
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        learning_rate=config.learning_rate,
        weight_decay=0.0,
        warmup_steps=config.warmup_steps,
        lr_scheduler_type=config.scheduler,
        logging_steps=config.logging_steps,
        save_strategy="steps",
        save_steps=config.save_steps,
        save_total_limit=config.save_total_limit,
        eval_strategy="steps" if evaluate else "no",
        eval_steps=config.save_steps,
        bf16=config.bf16,
        # asked for on a CPU: bf16 autocast there (AMX), and processes under torchrun/accelerate run as MULTI_CPU
        # (gloo) instead of each training alone
        use_cpu=not torch.cuda.is_available(),
        seed=config.seed,
        data_seed=config.seed,
        report_to="none",
        remove_unused_columns=False,
        label_names=["targets" if config.position_batch else "labels"],
        dataloader_pin_memory=torch.cuda.is_available(),
    )


def train(
    model: PreTrainedModel,
    tokenizer,
    conversations: list[list[dict]],
    output: str | Path,
    config: TrainConfig = TrainConfig(),
    *,
    init_heads: str | Path | None = None,
    resume: bool = False,
    merge: bool = False,
    callbacks: tuple = (),
) -> dict:
    """Trains heads (and, for medusa2, a LoRA adapter) on chat conversations; writes them to `output`.

    output/: the heads (MedusaHeads.save_pretrained), head_accuracy.json, train_config.json, checkpoints/;
    medusa2 also adapter/ (peft) and, with merge, model/ (merged; MedusaModel.from_pretrained(output)).
    Returns the held-out per-head accuracy.

    >>> train(model, tokenizer, read_conversations("distilled.jsonl"), "heads/", TrainConfig(epochs=1))
    """
    output = Path(output)
    if merge and config.mode != "medusa2":
        raise ValueError(f"merge: only a medusa2 run has an adapter to merge, got mode {config.mode!r}")
    last = last_checkpoint(output / CHECKPOINTS)
    if resume and last is None and not (output / STATES).is_dir():
        raise ValueError(f"resume: no checkpoint in {output / CHECKPOINTS} and no states in {output / STATES}")
    if not resume and last is not None:
        raise ValueError(f"output: {output} already holds checkpoints ({last}); resume, or choose another directory")
    set_seed(config.seed)
    examples = build_examples(tokenizer, conversations, config.max_length)
    train_set, eval_set = split(examples, config.eval_fraction, config.seed)
    heads = make_heads(model, config, init_heads)
    vocab = answer_vocab(train_set, heads.config.vocab_size, config.guess_vocab) if config.guess_vocab else None
    wrapper = MedusaTrainingModel(prepare_backbone(model, config), heads, config, vocab)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)  # masked out
    train_data, eval_data, collator = train_set, eval_set or None, partial(collate, pad_id=pad_id)
    if config.position_batch:
        teacher = config.targets == "teacher"
        states = partial(AnswerStates, model, heads, pad_id=pad_id, batch_size=config.batch_size,
                         backbone=backbone_key(model, heads, teacher), teacher=teacher)
        train_data = states(train_set, what="the training conversations", store=output / STATES)
        eval_data = states(eval_set, what="the held-out conversations", store=output / STATES) if eval_set else None
        collator = None
    trainer = MedusaTrainer(
        model=wrapper,
        args=training_arguments(output, config, evaluate=bool(eval_set)),
        data_collator=collator,
        train_dataset=train_data,
        eval_dataset=eval_data,
        compute_metrics=partial(head_metrics, num_heads=heads.config.num_heads),
        callbacks=list(callbacks),
        medusa=config,
        ramp=init_heads is None,
    )
    trainer.train(resume_from_checkpoint=str(last) if resume and last is not None else None)
    accuracy = head_accuracy(trainer.evaluate(), heads.config.num_heads, len(eval_set)) if eval_set else {}
    if wrapper.adapted and eval_set:
        accuracy["lm_top1_agreement"] = lm_agreement(wrapper, eval_set, pad_id, config.batch_size)
    if trainer.is_world_process_zero():  # under several processes (accelerate launch, torchrun) one writes
        save(wrapper, tokenizer, output, config, accuracy, merge)
        shutil.rmtree(output / STATES, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()  # every process returns once the output is written
    return accuracy


def lm_agreement(wrapper: MedusaTrainingModel, examples: list, pad_id: int, batch_size: int) -> float:
    """MEDUSA-2's fidelity: the share of answer positions, teacher-forced, where the adapted model's next-token
    argmax is the original model's (the same network with its adapter disabled)."""
    agree, total = 0, 0
    device = next(wrapper.heads.parameters()).device
    wrapper.eval()
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = {k: v.to(device) for k, v in collate(examples[start: start + batch_size], pad_id).items()}
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            keep = future_labels(batch["labels"], 1) != IGNORE_INDEX
            adapted = wrapper.backbone(**inputs).logits[keep].argmax(-1)
            with wrapper.backbone.disable_adapter():
                original = wrapper.backbone(**inputs).logits[keep].argmax(-1)
            agree, total = agree + int((adapted == original).sum()), total + int(keep.sum())
    return agree / max(total, 1)


def last_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint saved whole: the Trainer writes trainer_state.json last, so a run killed while
    saving leaves a checkpoint without a readable one, and resuming falls back to the one before."""
    saved = [p for p in directory.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if p.name.rsplit("-", 1)[1].isdigit()]
    for path in sorted(saved, key=lambda p: int(p.name.rsplit("-", 1)[1]), reverse=True):
        try:
            json.loads((path / TRAINER_STATE).read_text())
            return path
        except (OSError, json.JSONDecodeError):
            continue
    return None


def head_accuracy(metrics: dict, num_heads: int, examples: int) -> dict:
    heads = [
        {"head": k, "predicts": f"t+{k + HEAD_OFFSET}", "top1": metrics[f"eval_head{k}_top1"],
         "top5": metrics[f"eval_head{k}_top5"], "tokens": metrics[f"eval_head{k}_tokens"]}
        for k in range(num_heads)
    ]
    return {"eval_examples": examples, "eval_loss": metrics["eval_loss"], "heads": heads}


def save(wrapper: MedusaTrainingModel, tokenizer, output: Path, config: TrainConfig, accuracy: dict, merge: bool):
    wrapper.heads.save_pretrained(output)
    (output / TRAIN_CONFIG_NAME).write_text(json.dumps(asdict(config), indent=2) + "\n")
    if accuracy:
        (output / TRAIN_ACCURACY_NAME).write_text(json.dumps(accuracy, indent=2) + "\n")
    if wrapper.adapted:
        wrapper.backbone.save_pretrained(output / ADAPTER_DIR, save_embedding_layers=False)  # lm_head: its LoRA is enough
        if merge:
            merged = wrapper.backbone.merge_and_unload()
            merged.save_pretrained(output / MERGED_DIR)
            tokenizer.save_pretrained(output / MERGED_DIR)
