"""A conversation as token ids: through the tokenizer's chat template, or raw, as a base model (no template) reads
text: the turns' own ids one after another, a user turn after another set apart by a blank line. Raw, an answer is
the continuation of what came before, its ids as the model produced them (no turn is tokenized across another's
boundary), so a conversation's ids are a prefix of its ids with a turn added."""

TURN_GAP = "\n\n"  # before a raw user turn that follows another turn


def is_raw(tokenizer, raw: bool = False) -> bool:
    """Whether conversations render raw: asked for, or the model has no chat template (a base model)."""
    return raw or not tokenizer.chat_template


def chat_ids(tokenizer, chat: list[dict], generation_prompt: bool = False, raw: bool = False) -> list[int]:
    """chat: messages {"role", "content"} -> ids; generation_prompt: the template's header of the answer to come
    (raw: nothing, the answer continues the text)."""
    if not is_raw(tokenizer, raw):
        return list(tokenizer.apply_chat_template(chat, add_generation_prompt=generation_prompt, return_dict=False))
    ids = list(tokenizer("")["input_ids"])  # the tokenizer's leading special tokens (a BOS), if any
    for i, message in enumerate(chat):
        gap = TURN_GAP if i and message["role"] != "assistant" else ""
        ids += tokenizer(gap + message["content"], add_special_tokens=False)["input_ids"]
    return ids
