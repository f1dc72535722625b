"""The Hugging Face `Trainer` set up for heads: its arguments, MEDUSA-2's lambda in compute_loss, the heads' own
learning rate in create_optimizer, and per-head accuracy as its metrics."""

import math
from pathlib import Path

import torch
from transformers import EvalPrediction, Trainer, TrainingArguments

from ..config import TrainConfig
from .data import IGNORE_INDEX
from .positions import HEAD_OFFSET, answer_mask, future_labels

CHECKPOINTS = "checkpoints"


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
        metrics |= {f"head{k}_top1": top1 / max(count, 1), f"head{k}_top5": top5 / max(count, 1),
                    f"head{k}_tokens": count}
    return metrics


def head_accuracy(metrics: dict, num_heads: int, examples: int) -> dict:
    heads = [
        {"head": k, "predicts": f"t+{k + HEAD_OFFSET}", "top1": metrics[f"eval_head{k}_top1"],
         "top5": metrics[f"eval_head{k}_top5"], "tokens": metrics[f"eval_head{k}_tokens"]}
        for k in range(num_heads)
    ]
    return {"eval_examples": examples, "eval_loss": metrics["eval_loss"], "heads": heads}


def training_arguments(output: Path, config: TrainConfig, evaluate: bool) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(output / CHECKPOINTS),
        num_train_epochs=config.epochs,
        max_steps=config.max_steps,
        per_device_train_batch_size=config.position_batch or config.batch_size,
        per_device_eval_batch_size=config.position_batch or config.batch_size,
        # batches of conversations of similar lengths: padding was most of the tokens
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
