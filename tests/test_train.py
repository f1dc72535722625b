"""Head training: target alignment, assistant-only labels, MEDUSA-1 / MEDUSA-2 on tiny models, resume, errors."""

import json
import math
import shutil
from itertools import groupby

import pytest
import torch
from conftest import tiny_model, tiny_tokenizer
from safetensors.torch import load_file
from transformers import AutoTokenizer, TrainerCallback

from medusa_decoding import MedusaModel, embedded
from medusa_decoding.cli import main
from medusa_decoding.config import HeadsConfig, TrainConfig
from medusa_decoding.heads import MedusaHeads, run_backbone
from medusa_decoding.training import losses as losses_module
from medusa_decoding.training import states as states_module
from medusa_decoding.training.data import IGNORE_INDEX, assistant_labels, build_examples, collate, read_conversations
from medusa_decoding.training.losses import MedusaTrainingModel, heads_loss
from medusa_decoding.training.positions import at_answers, future_labels
from medusa_decoding.training.start import load_backbone, make_heads, prepare_backbone
from medusa_decoding.training.states import AnswerStates
from medusa_decoding.training.train import lm_agreement, train
from medusa_decoding.training.trainer import heads_weight

pytestmark = pytest.mark.usefixtures("one_thread")
X = IGNORE_INDEX  # a label no loss counts, short for the label tensors below
CONFIG = TrainConfig(num_heads=3, max_steps=30, batch_size=4, learning_rate=1e-2, warmup_steps=2, save_steps=10,
                     logging_steps=5, eval_fraction=0.2)


def counting(n: int = 24, length: int = 12) -> list[list[dict]]:
    """Answers that count up word by word: every head can learn its offset."""
    return [
        [{"role": "user", "content": "w1 w2 w3"},
         {"role": "assistant", "content": " ".join(f"w{s + i}" for i in range(length))}]
        for s in range(n)
    ]


class Recorder(TrainerCallback):
    """Training losses as logged, and the optimizer's parameter groups."""

    def __init__(self):
        self.losses, self.groups = [], []

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.groups = [(group["initial_lr"], {id(p) for p in group["params"]}) for group in optimizer.param_groups]

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.losses.append(logs["loss"])


class Kill(TrainerCallback):
    """Raises after step `at`'s update, before it could be checkpointed: a process killed mid-run."""

    def __init__(self, at: int):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise KeyboardInterrupt(f"killed at step {self.at}")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def model_for(tokenizer, **overrides):
    return tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)


def test_future_labels_shift_targets_left_by_the_offset():
    labels = torch.tensor([[X, X, X, 13, 14, 15, 16]])
    assert future_labels(labels, 1).tolist() == [[X, X, 13, 14, 15, 16, X]]  # the LM head: t+1
    assert future_labels(labels, 2).tolist() == [[X, 13, 14, 15, 16, X, X]]  # head 0: t+2


@pytest.mark.parametrize("shift, hit", [(0, True), (-1, False)])
def test_head_k_is_trained_on_the_token_k_plus_2_ahead(shift, hit):
    """Oracle heads: head k maps the one-hot hidden state of position t to token x[t+k+2+shift]."""
    tokens = [7, 8, 9, 10, 11, 12, 13]
    labels = torch.tensor([[X, X, X, 10, 11, 12, 13]])  # positions 0-2 are the prompt
    length, vocab = len(tokens), 20
    heads = MedusaHeads(HeadsConfig(hidden_size=length, vocab_size=vocab, num_heads=3, projection="own"))
    with torch.no_grad():
        for k, head in enumerate(heads.heads):
            head[-1].weight.zero_()
            for t in range(length):
                if 0 <= t + k + 2 + shift < length:
                    head[-1].weight[tokens[t + k + 2 + shift], t] = 30.0
    state, targets, _, rows = at_answers(torch.eye(length)[None], torch.tensor([tokens]), labels, num_heads=3)
    assert rows.tolist() == [0] * 5  # t=0..4 have a target
    with torch.no_grad():
        loss, hits = heads_loss(heads, None, state, targets, decay=0.8)
    # targets by hand: head 0 at t=1..4 (x3..x6), head 1 at t=0..3, head 2 at t=0..2
    assert hits.sum(0)[:, 2].tolist() == [4, 4, 3]
    assert hits.sum(0)[:, 0].tolist() == ([4, 4, 3] if hit else [0, 0, 0])
    assert (loss < 1e-6) if hit else (loss > 10)


@pytest.mark.parametrize("shift, hit", [(0, True), (-1, False)])
def test_hydra_head_k_reads_the_tokens_t_plus_1_to_t_plus_k_plus_1(shift, hit):
    """Hand-set hydra heads on one-hot embeddings of a counting sequence: head k passes on the embedding of the
    (k+1)-th token after t (the last it reads: x[t+k+1+shift]) and projects token a onto a+1, so it is right exactly
    when it reads x[t+k+1] and is trained on x[t+k+2]."""
    tokens = torch.arange(3, 12)[None]  # counting: the token after a is a + 1
    labels = tokens.clone()
    labels[0, :3] = X
    vocab = 16
    embed = torch.nn.Embedding(vocab, vocab, _weight=torch.eye(vocab))
    heads = MedusaHeads(HeadsConfig(hidden_size=vocab, vocab_size=vocab, num_heads=3, projection="own", kind="hydra"))
    with torch.no_grad():
        for k, head in enumerate(heads.heads):
            head[0].linear.weight.zero_()
            column = (k + 1 + shift) * vocab  # [h; e(x[t+1]); ...; e(x[t+k+1])]: the block of x[t+k+1+shift]
            head[0].linear.weight[:, column : column + vocab] = 10 * torch.eye(vocab)
            head[-1].weight.copy_(30 * torch.eye(vocab).roll(1, 0))  # a -> a + 1
        state, targets, path, _ = at_answers(torch.zeros(1, 9, vocab), tokens, labels, num_heads=3)
        assert path.tolist()[0] == [4, 5, 6] and path.tolist()[-1] == [10, 11, 11]  # t=0..6; past the end: the last
        loss, hits = heads_loss(heads, None, state, targets, decay=0.8, embeds=embed(path))
    assert hits.sum(0)[:, 2].tolist() == [6, 6, 5]  # targets: x[t+k+2] among x3..x8
    assert hits.sum(0)[:, 0].tolist() == ([6, 6, 5] if hit else [0, 0, 0])
    assert (loss < 1e-6) if hit else (loss > 10)


def test_the_loss_in_chunks_is_the_loss_at_once(monkeypatch):
    """Chunks of 4 positions (logits recomputed in backward when training): the loss, gradients and hits of all
    positions at once."""
    torch.manual_seed(0)
    heads = MedusaHeads(HeadsConfig(hidden_size=8, vocab_size=5, num_heads=3, projection="own"))  # some hits by chance
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.5)
    hidden, labels = torch.randn(2, 9, 8), torch.randint(0, 5, (2, 9))
    labels[0, :3], labels[1, 6:] = X, X  # a prompt, and padding
    logits = heads(hidden)  # [K, B, T, V]
    targets = [future_labels(labels, k + 2) for k in range(3)]
    at_once = sum(0.8 ** k * torch.nn.functional.cross_entropy(logits[k].flatten(0, 1), targets[k].flatten(),
                                                                ignore_index=X) for k in range(3))
    top1 = torch.stack([((logits[k].argmax(-1) == targets[k]) & (targets[k] != X)).sum(-1) for k in range(3)], 1)
    monkeypatch.setattr(losses_module, "LOSS_CHUNK", 4)
    state, chosen, _, rows = at_answers(hidden, labels.clamp(min=0), labels, num_heads=3)
    loss, none = heads_loss(heads, None, state, chosen, decay=0.8)
    assert none is None  # training reads no hits
    with torch.no_grad():
        evaluated, hits = heads_loss(heads, None, state, chosen, decay=0.8)
    hits = hits.new_zeros(2, 3, 3).index_add_(0, rows, hits)  # per conversation
    torch.testing.assert_close(evaluated, at_once.detach())
    for chunked, whole in zip(torch.autograd.grad(loss, list(heads.parameters())),
                              torch.autograd.grad(at_once, list(heads.parameters()))):
        torch.testing.assert_close(chunked, whole)
    torch.testing.assert_close(loss, at_once)
    assert hits[..., 0].tolist() == top1.tolist() and hits[..., 0].sum() > 0
    assert hits[..., 2].tolist() == [[(t[b] != X).sum().item() for t in targets] for b in range(2)]


def test_labels_cover_exactly_the_assistant_turns_with_the_real_template():
    tokenizer = AutoTokenizer.from_pretrained(embedded.converted_dir())  # SmolLM2: BPE, default system prompt
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    ids, labels = assistant_labels(tokenizer, chat)
    assert ids == tokenizer.apply_chat_template(chat, return_dict=False)
    runs = groupby(zip(ids, labels), key=lambda pair: pair[1] != X)
    spans = [tokenizer.decode([token for token, _ in run]) for trained, run in runs if trained]
    assert spans == ["Hello! How can I help?<|im_end|>\n", "Blue.<|im_end|>\n"]


def test_heads_weight_ramps_along_a_sine_only_for_medusa2_without_init_heads():
    medusa2 = TrainConfig(mode="medusa2", warmup_steps=10, lambda0=0.2)
    assert heads_weight(TrainConfig(), 0, ramp=True) == 1.0
    assert [heads_weight(medusa2, s, ramp=True) for s in (0, 5, 10, 50)] == pytest.approx(
        [0.0, 0.2 * math.sin(math.pi / 4), 0.2, 0.2])
    assert heads_weight(medusa2, 0, ramp=False) == 0.2


@pytest.mark.parametrize("kind, layers, positions", [("medusa", (), 0), ("hydra", (), 0), ("hydra", (1,), 0),
                                                     ("hydra", (), 16)])
def test_medusa1_learns_and_leaves_every_backbone_parameter_bit_identical(tokenizer, tmp_path, kind, layers, positions):
    model = model_for(tokenizer)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = Recorder()
    config = TrainConfig(**{**CONFIG.__dict__, "projection": "own", "kind": kind, "feature_layers": layers,
                            "position_batch": positions})
    accuracy = train(model, tokenizer, counting(), tmp_path / "heads", config, callbacks=[recorder])
    assert recorder.losses[-1] < 0.6 * recorder.losses[0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert len(recorder.groups) == 1  # the heads alone are optimised
    saved = json.loads((tmp_path / "heads" / "head_accuracy.json").read_text())
    assert saved == json.loads(json.dumps(accuracy))
    assert [h["predicts"] for h in saved["heads"]] == ["t+2", "t+3", "t+4"]
    assert saved["heads"][0]["top5"] > 0.5
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    medusa = MedusaModel.from_pretrained(tmp_path / "base", tmp_path / "heads")
    assert medusa.heads.config.num_heads == 3 and medusa.heads.config.kind == kind
    assert medusa.heads.config.feature_layers == layers
    assert medusa.generate("w1 w2 w3", max_new_tokens=8).token_ids == medusa.generate(
        "w1 w2 w3", max_new_tokens=8, medusa=False).token_ids


def random_heads(model, config: TrainConfig, vocab: torch.Tensor | None):
    """Heads with random weights (some of their guesses right by chance), and the training model around them."""
    heads = make_heads(model, config, None)
    torch.manual_seed(0)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads, MedusaTrainingModel(prepare_backbone(model, config), heads, config, vocab).eval()


@pytest.mark.parametrize("kind, layers, vocab", [("medusa", (), None), ("hydra", (1,), torch.tensor([3, 9, 4, 20]))])
def test_a_batch_of_cached_states_gives_the_loss_and_hits_of_its_conversations(tokenizer, tmp_path, kind, layers,
                                                                               vocab):
    """AnswerStates hold exactly what training reads of a batch of conversations: forward on all of its positions
    gives the same loss and hits, with or without a guess vocabulary."""
    model = model_for(tokenizer)
    config = TrainConfig(num_heads=3, kind=kind, feature_layers=layers, projection="shared",
                         guess_vocab=0 if vocab is None else len(vocab))
    heads, wrapper = random_heads(model, config, vocab)
    examples = build_examples(tokenizer, counting(6), 64)
    states = AnswerStates(model, heads, examples, pad_id=0, batch_size=len(examples), what="a test",
                          store=tmp_path, backbone="")
    # one answer each: some head's target lies in it from K+1 positions before it to 2 before its end
    assert len(states) == sum(sum(label != X for label in e["labels"]) + 3 - 1 for e in examples)
    cached = {k: torch.stack([states[i][k] for i in range(len(states))]) for k in ("state", "targets", "path")}
    with torch.no_grad():
        whole = wrapper(**collate(examples, pad_id=0))
        positions = wrapper(**cached)
    torch.testing.assert_close(positions["loss"], whole["loss"])
    assert torch.equal(positions["head_hits"].sum(0), whole["head_hits"].sum(0))
    assert whole["head_hits"][..., 0].sum() > 0  # random heads, some hits: the comparison has teeth


@pytest.mark.parametrize("vocab", [None, torch.tensor([3, 9, 4, 20, 7])])
def test_teacher_targets_are_the_frozen_models_distribution_over_each_heads_token(tokenizer, tmp_path, vocab):
    """targets "teacher": head k at t learns the model's own distribution at t+k+1 (over the guess vocabulary and the
    batch's targets beside it where there is one), computed here from the model's logits by hand; cached positions
    give the same (their states ahead kept in bfloat16: to a thousandth)."""
    model = model_for(tokenizer)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # a teacher sure of its next token, which differs from position to position
    config = TrainConfig(num_heads=3, kind="hydra", targets="teacher", guess_vocab=0 if vocab is None else len(vocab))
    heads, wrapper = random_heads(model, config, vocab)
    examples = build_examples(tokenizer, counting(6), 64)
    batch = collate(examples, pad_id=0)
    with torch.no_grad():
        whole = wrapper(**batch)["loss"]
        hidden, state = run_backbone(model, (), input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        state, targets, path, _ = at_answers(state, batch["input_ids"], batch["labels"], num_heads=3)
        extra = targets[targets != X].unique()  # the batch's targets outside the vocabulary, ranked beside it
        columns = slice(None) if vocab is None else torch.cat([vocab, extra[~torch.isin(extra, vocab)]])
        teacher = model.lm_head(hidden)[..., columns].log_softmax(-1)  # [B, T, V']: the model's at each position
        guesses = heads(state, model.lm_head, embeds=model.get_input_embeddings()(path))[..., columns].log_softmax(-1)
        positions = (torch.stack([future_labels(batch["labels"], k + 2) for k in range(3)]) != X).any(0).nonzero()

        def by_hand(ahead: int) -> torch.Tensor:  # CE(the model at t+k+ahead, head k at t), over head k's targets
            return sum(0.8 ** k * torch.stack([-(teacher[b, t + k + ahead].exp() * guesses[k, n]).sum()
                                               for n, (b, t) in enumerate(positions.tolist())
                                               if targets[k, n] != X]).mean()
                       for k in range(3))

        expected = by_hand(1)
        cached = AnswerStates(model, heads, examples, pad_id=0, batch_size=len(examples), what="a test",
                              store=tmp_path, backbone="", teacher=True)
        items = {k: torch.stack([cached[i][k] for i in range(len(cached))])
                 for k in ("state", "targets", "path", "ahead")}
        positions_loss = wrapper(**items)["loss"]
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(positions_loss, expected, rtol=1e-3, atol=0)
    for wrong in (by_hand(0), by_hand(2)):  # the teacher a position off: the comparison has teeth
        assert abs(wrong - expected) > 10 * 1e-3 * expected  # ten times the tolerance above


def test_teacher_targets_train_the_heads_towards_the_models_own_distribution(tokenizer, tmp_path):
    """`medusa train --targets teacher` on cached positions: the heads' cross-entropy to the frozen model's own
    distributions falls, and the backbone is left bit-identical."""
    model = model_for(tokenizer)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)  # a teacher sure of its next token: much for the heads to learn
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = TrainConfig(**{**CONFIG.__dict__, "kind": "hydra", "position_batch": 16, "targets": "teacher"})
    recorder = Recorder()
    accuracy = train(model, tokenizer, counting(), tmp_path / "heads", config, callbacks=[recorder])
    assert recorder.losses[-1] < 0.75 * recorder.losses[0]
    assert accuracy["eval_loss"] < 0.75 * recorder.losses[0]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert json.loads((tmp_path / "heads" / "train_config.json").read_text())["targets"] == "teacher"


def test_medusa2_kl_is_zero_at_initialisation_and_the_disabled_adapter_is_the_original(tokenizer):
    config = TrainConfig(mode="medusa2", num_heads=2)
    model = model_for(tokenizer, tie_word_embeddings=True)
    batch = collate(build_examples(tokenizer, counting(4), 64), pad_id=0)
    with torch.no_grad():
        original = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    wrapper = MedusaTrainingModel(prepare_backbone(model, config), make_heads(model, config, None), config).train()
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def kl() -> float:
        hidden = wrapper.hidden_states(ids, mask)[0]
        return wrapper.lm_loss(wrapper.causal_lm.get_output_embeddings(), hidden, ids, mask, batch["labels"]).item()

    assert kl() == 0.0  # LoRA B = 0: the student is the original
    examples = build_examples(tokenizer, counting(4), 64)
    assert lm_agreement(wrapper, examples, 0, 2) == 1.0
    with torch.no_grad():
        for name, p in wrapper.backbone.named_parameters():
            if "lora_B" in name:
                p.normal_()
        adapted = wrapper.backbone(input_ids=ids, attention_mask=mask).logits
        with wrapper.backbone.disable_adapter():
            disabled = wrapper.backbone(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(adapted, original)
    assert torch.equal(disabled, original)
    assert kl() > 0
    assert lm_agreement(wrapper, examples, 0, 2) < 1.0  # random LoRA moves some argmaxes


def test_medusa2_learns_and_its_merged_output_loads_in_medusa_model(tokenizer, tmp_path):
    from peft import PeftModel

    overrides = {"mode": "medusa2", "lambda0": 1.0, "warmup_steps": 0, "learning_rate": 3e-2}  # no ramp: one loss
    recorder = Recorder()
    train(model_for(tokenizer, tie_word_embeddings=True), tokenizer, counting(), tmp_path / "out",
          TrainConfig(**{**CONFIG.__dict__, **overrides}), merge=True, callbacks=[recorder])
    assert recorder.losses[-1] < 0.75 * recorder.losses[0]
    assert 0 <= json.loads((tmp_path / "out" / "head_accuracy.json").read_text())["lm_top1_agreement"] <= 1
    (heads_lr, heads_params), (backbone_lr, _) = recorder.groups
    assert heads_lr == pytest.approx(4 * backbone_lr)

    ids = torch.tensor([tokenizer.apply_chat_template(counting(1)[0], return_dict=False)])
    original = model_for(tokenizer, tie_word_embeddings=True)
    with torch.no_grad():
        expected = original(ids).logits
        adapted = PeftModel.from_pretrained(model_for(tokenizer, tie_word_embeddings=True),
                                            tmp_path / "out" / "adapter")
        with adapted.disable_adapter():
            assert torch.equal(adapted(ids).logits, expected)
        medusa = MedusaModel.from_pretrained(tmp_path / "out")  # the merged backbone + its heads
        merged = medusa.model(ids).logits
        assert torch.allclose(merged, adapted(ids).logits, atol=1e-5) and not torch.allclose(merged, expected)
    assert torch.equal(medusa.model.get_input_embeddings().weight, original.get_input_embeddings().weight)
    trained = load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(v, medusa.heads.state_dict()[k]) for k, v in trained.items())
    original.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    with torch.no_grad():  # the same through the adapter: base + heads directory, or the output holding no merged model
        loaded = MedusaModel.from_pretrained(tmp_path / "base", tmp_path / "out")
        assert torch.allclose(loaded.model(ids).logits, merged, atol=1e-5)
        shutil.rmtree(tmp_path / "out" / "model")
        (tmp_path / "out" / "adapter" / "adapter_config.json").write_text(json.dumps({
            **json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text()),
            "base_model_name_or_path": str(tmp_path / "base")}))
        medusa = MedusaModel.from_pretrained(tmp_path / "out")
        assert torch.allclose(medusa.model(ids).logits, merged, atol=1e-5)
    assert torch.equal(medusa.model.get_input_embeddings().weight, original.get_input_embeddings().weight)


@pytest.mark.parametrize("mode, positions", [("medusa2", 0), ("medusa1", 32)])
def test_a_killed_run_resumes_to_the_same_heads_and_adapter(tokenizer, tmp_path, mode, positions):
    config = TrainConfig(**{**CONFIG.__dict__, "mode": mode, "max_steps": 6, "save_steps": 2, "eval_fraction": 0.0,
                            "position_batch": positions})
    data = counting(20)  # 5 steps an epoch: the run crosses an epoch boundary
    train(model_for(tokenizer), tokenizer, data, tmp_path / "whole", config)
    with pytest.raises(KeyboardInterrupt):
        train(model_for(tokenizer), tokenizer, data, tmp_path / "killed", config, callbacks=[Kill(at=5)])
    assert not (tmp_path / "killed" / "model.safetensors").exists()
    partial = tmp_path / "killed" / "checkpoints" / "checkpoint-6"  # a later kill, in the middle of a save
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\0" * 100)
    train(model_for(tokenizer), tokenizer, data, tmp_path / "killed", config, resume=True)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors")[: 2 if mode == "medusa2" else 1]:
        whole, resumed = load_file(tmp_path / "whole" / name), load_file(tmp_path / "killed" / name)
        assert whole.keys() == resumed.keys()
        assert all(torch.equal(whole[k], resumed[k]) for k in whole), name


def test_a_run_killed_while_computing_states_goes_on_from_its_parts(tokenizer, tmp_path, monkeypatch):
    """With position_batch the backbone's states are kept in parts as they are computed, each naming its
    conversations: a run killed among them, resumed on more data, computes only the conversations no readable part
    holds (those of a damaged file, of a part overwritten by another, never computed, new), ends with the heads of a
    run never killed, and leaves no states behind."""
    monkeypatch.setattr(states_module, "PART", 4)
    config = TrainConfig(**{**CONFIG.__dict__, "max_steps": 6, "save_steps": 100, "eval_fraction": 0.0,
                            "position_batch": 32})
    data, grown = counting(20), counting(28)  # 5 parts; 8 conversations more
    train(model_for(tokenizer), tokenizer, grown, tmp_path / "whole", config)
    assert not (tmp_path / "whole" / "states").exists()
    computed, real, kill_at = [], states_module.compute_part, [3]

    def computing(*args):
        if len(computed) == kill_at[0]:
            raise KeyboardInterrupt("killed")
        computed.append(args[2])  # the part's conversations
        return real(*args)

    monkeypatch.setattr(states_module, "compute_part", computing)
    with pytest.raises(KeyboardInterrupt):
        train(model_for(tokenizer), tokenizer, data, tmp_path / "killed", config)
    parts = sorted((tmp_path / "killed" / "states").glob("part-*.safetensors"))
    assert len(parts) == 3
    parts[1].write_bytes(b"\0" * 100)
    shutil.copy(parts[0], parts[2])
    computed.clear()
    kill_at[0] = None
    train(model_for(tokenizer), tokenizer, grown, tmp_path / "killed", config, resume=True)
    assert sum(map(len, computed)) == 28 - 4  # only the first part's conversations were read back
    assert not (tmp_path / "killed" / "states").exists()
    whole, resumed = (load_file(tmp_path / run / "model.safetensors") for run in ("whole", "killed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_cli_trains_from_a_distilled_file_and_starts_from_init_heads(tokenizer, tmp_path):
    model_for(tokenizer).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    data = tmp_path / "distilled.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]} for m in chat]}) + "\n"
        for i, chat in enumerate(counting(8))))
    common = ["--data", str(data), "--model", str(tmp_path / "base"), "--num-heads", "2", "--max-steps", "2",
              "--batch-size", "4", "--eval-fraction", "0.25"]
    main(["train", *common, "--output", str(tmp_path / "m1")])
    main(["train", *common, "--output", str(tmp_path / "m2"), "--mode", "medusa2",
          "--init-heads", str(tmp_path / "m1")])
    assert json.loads((tmp_path / "m2" / "train_config.json").read_text())["mode"] == "medusa2"
    assert len(json.loads((tmp_path / "m2" / "head_accuracy.json").read_text())["heads"]) == 2
    with pytest.raises(SystemExit):  # checkpoints there already: resume, or another directory
        main(["train", *common, "--output", str(tmp_path / "m1")])


def test_init_heads_are_the_starting_point(tokenizer, tmp_path):
    model = model_for(tokenizer)
    config = TrainConfig(num_heads=2, projection="own")
    saved = make_heads(model, config, None)
    with torch.no_grad():
        for p in saved.parameters():
            p.normal_()
    saved.save_pretrained(tmp_path)
    loaded = make_heads(model, config, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), loaded.state_dict().values()))


def test_medusa_heads_start_hydra_heads_with_the_same_logits(tokenizer, tmp_path):
    model = model_for(tokenizer)
    medusa = make_heads(model, TrainConfig(num_heads=3), None)
    with torch.no_grad():
        for p in medusa.parameters():
            p.normal_()
    medusa.save_pretrained(tmp_path)
    hydra = make_heads(model, TrainConfig(num_heads=3, kind="hydra"), tmp_path)
    assert hydra.config.kind == "hydra"
    hidden, lm_head = torch.randn(5, model.config.hidden_size), model.get_output_embeddings()
    embeds = model.get_input_embeddings()(torch.randint(len(tokenizer), (5, 3)))
    with torch.no_grad():
        torch.testing.assert_close(hydra(hidden, lm_head, embeds=embeds), medusa(hidden, lm_head), rtol=1e-6, atol=1e-6)
    hydra.save_pretrained(tmp_path / "hydra")
    with pytest.raises(ValueError, match="kind='hydra', but training asks for kind='medusa'"):
        make_heads(model, TrainConfig(num_heads=3), tmp_path / "hydra")


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_trained_heads_start_heads_that_read_a_layer_with_the_same_logits(tokenizer, tmp_path, kind):
    model = model_for(tokenizer)
    plain = make_heads(model, TrainConfig(num_heads=3, kind=kind), None)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_()
    plain.save_pretrained(tmp_path)
    fused = make_heads(model, TrainConfig(num_heads=3, kind=kind, feature_layers=(1,)), tmp_path)
    assert fused.config.feature_layers == (1,)
    size = model.config.hidden_size
    assert not fused.heads[2][0].linear.weight[:, size: 2 * size].any()  # the layer's columns start at zero
    hidden, layer, lm_head = torch.randn(5, size), torch.randn(5, size), model.get_output_embeddings()
    embeds = model.get_input_embeddings()(torch.randint(len(tokenizer), (5, 3))) if kind == "hydra" else None
    with torch.no_grad():  # a wider product (zeros added in): the same values up to BLAS's choice of rounding
        torch.testing.assert_close(fused(torch.cat([hidden, layer], -1), lm_head, embeds=embeds),
                                   plain(hidden, lm_head, embeds=embeds), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"read the outputs of layers \[2\], but .* has 2 layers"):
        make_heads(model, TrainConfig(num_heads=3, kind=kind, feature_layers=(2,)), tmp_path)


@pytest.mark.parametrize("kind, projection", [("medusa", "shared"), ("medusa", "own"), ("hydra", "shared")])
def test_trained_heads_start_deeper_heads_with_the_same_logits(tokenizer, tmp_path, kind, projection):
    model = model_for(tokenizer)
    shallow = make_heads(model, TrainConfig(num_heads=3, kind=kind, projection=projection), None)
    with torch.no_grad():
        for p in shallow.parameters():
            p.normal_()
    shallow.save_pretrained(tmp_path)
    deep = make_heads(model, TrainConfig(num_heads=3, num_layers=3, kind=kind, projection=projection), tmp_path)
    assert deep.config.num_layers == 3 and not any(p.any() for p in deep.heads[0][2].parameters())  # the identity
    hidden, lm_head = torch.randn(5, model.config.hidden_size), model.get_output_embeddings()
    embeds = model.get_input_embeddings()(torch.randint(len(tokenizer), (5, 3))) if kind == "hydra" else None
    with torch.no_grad():
        assert torch.equal(deep(hidden, lm_head, embeds=embeds), shallow(hidden, lm_head, embeds=embeds))
    deep.save_pretrained(tmp_path / "deep")
    with pytest.raises(ValueError, match="num_layers=3, but training asks for num_layers=2"):  # never shallower
        make_heads(model, TrainConfig(num_heads=3, num_layers=2, kind=kind, projection=projection), tmp_path / "deep")


def test_errors(tokenizer, tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_conversations(empty)
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"id": "q", "conversations": [{"from": "human", "value": "w1"}]}) + "\n")
    with pytest.raises(ValueError, match="no assistant turns"):
        train(model_for(tokenizer), tokenizer, read_conversations(questions), tmp_path / "out", CONFIG)

    other = tiny_model("llama", vocab_size=len(tokenizer), hidden_size=64)  # another base model
    make_heads(other, CONFIG, None).save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="hidden_size=64"):
        make_heads(model_for(tokenizer), CONFIG, tmp_path / "other")
    make_heads(model_for(tokenizer), TrainConfig(num_heads=2), None).save_pretrained(tmp_path / "two")
    with pytest.raises(ValueError, match="num_heads=2"):
        make_heads(model_for(tokenizer), TrainConfig(num_heads=3), tmp_path / "two")

    with pytest.raises(ValueError, match="no checkpoint"):
        train(model_for(tokenizer), tokenizer, counting(4), tmp_path / "fresh", CONFIG, resume=True)
    with pytest.raises(ValueError, match="merge"):
        train(model_for(tokenizer), tokenizer, counting(4), tmp_path / "m1", CONFIG, merge=True)
    with pytest.raises(ValueError, match="mode"):
        TrainConfig(mode="medusa3")
    with pytest.raises(ValueError, match="position_batch caches a frozen backbone"):
        TrainConfig(mode="medusa2", position_batch=256)
    with pytest.raises(ValueError, match="position_batch must be"):
        TrainConfig(position_batch=-1)
    with pytest.raises(ValueError, match="targets must be one of"):
        TrainConfig(targets="labels")
    with pytest.raises(ValueError, match="targets 'teacher' is the frozen backbone's distribution"):
        TrainConfig(mode="medusa2", targets="teacher")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA GPU"):
        load_backbone(None, TrainConfig(quantize="4bit"))
