"""Head training on the Hugging Face `Trainer`: one process, or several under torchrun or accelerate (docs/training.md).
`train` runs it, resumes it from its last whole checkpoint, and writes the heads; the objective is in losses.py, the
Trainer's setup in trainer.py, the backbone and heads it starts from in start.py.

MEDUSA-1 trains on batches of conversations, or (position_batch) on batches of answer positions whose states the
frozen backbone computed once (AnswerStates): the same loss, with the backbone's cost paid once instead of every
epoch, and many more updates an epoch.
"""

import json
import shutil
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel, set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..config import TrainConfig
from ..formats import ADAPTER_DIR, MERGED_DIR, TRAIN_ACCURACY_NAME, TRAIN_CONFIG_NAME
from .data import IGNORE_INDEX, answer_vocab, build_examples, collate, split
from .losses import MedusaTrainingModel
from .positions import future_labels
from .start import make_heads, prepare_backbone
from .states import AnswerStates, backbone_key
from .trainer import CHECKPOINTS, MedusaTrainer, head_accuracy, head_metrics, training_arguments

STATES = "states"  # position_batch: the backbone's states, kept in parts until the run ends (states.AnswerStates)
TRAINER_STATE = "trainer_state.json"  # the last file the Trainer writes into a checkpoint
TRAIN = TrainConfig()  # train's settings unless given others (frozen: one instance serves every call)


def train(
    model: PreTrainedModel,
    tokenizer,
    conversations: list[list[dict]],
    output: str | Path,
    config: TrainConfig = TRAIN,
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


def save(wrapper: MedusaTrainingModel, tokenizer, output: Path, config: TrainConfig, accuracy: dict, merge: bool):
    wrapper.heads.save_pretrained(output)
    (output / TRAIN_CONFIG_NAME).write_text(json.dumps(asdict(config), indent=2) + "\n")
    if accuracy:
        (output / TRAIN_ACCURACY_NAME).write_text(json.dumps(accuracy, indent=2) + "\n")
    if wrapper.adapted:
        # lm_head: its LoRA is enough
        wrapper.backbone.save_pretrained(output / ADAPTER_DIR, save_embedding_layers=False)
        if merge:
            merged = wrapper.backbone.merge_and_unload()
            merged.save_pretrained(output / MERGED_DIR)
            tokenizer.save_pretrained(output / MERGED_DIR)
