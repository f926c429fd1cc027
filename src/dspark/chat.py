"""Prompts as token ids, with the control-token defence: user text is tokenized as text (a typed '<|im_end|>' stays
characters), and only the chat template's own text may produce control tokens."""

from __future__ import annotations

import re
from functools import partial

from dspark.errors import DSparkError


def check_text(text: str, what: str = "the prompt") -> str:
    """User text must be Unicode that UTF-8 can carry: bytes that were not UTF-8 reach Python as lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DSparkError(
            f"{what} is not valid UTF-8 text (a stray byte or lone surrogate at character {e.start}); pass UTF-8 text"
        ) from e
    return text


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of user-supplied text, as text: a control token's spelling typed by a user ('<|im_end|>') is
    tokenized as ordinary characters, never as the control token."""
    check_text(text)
    return list(tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True)["input_ids"])


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids that prompt for the assistant's next reply: the model's chat template, or for a base model that
    ships none, the messages' texts one per line.

    Only the template's own text may produce control tokens: it is rendered with a placeholder for each message's
    content, the placeholders cut it into template pieces (tokenized with control tokens) and contents (tokenized
    as text), so no message can close its turn or open a forged system turn."""
    for m in messages:
        check_text(m["content"], f"the {m.get('role', 'message')} message")
    if not tokenizer.chat_template:
        return encode_text(tokenizer, "\n".join(m["content"] for m in messages))
    render = partial(tokenizer.apply_chat_template, add_generation_prompt=True, tokenize=False)
    marks = [f"\ue000{i}\ue001" for i in range(len(messages))]
    skeleton = render([dict(m, content=mark) for m, mark in zip(messages, marks)])
    rendered = render(messages)
    pieces = re.split("(\ue000\\d+\ue001)", skeleton)
    for transform in (lambda t: t, str.strip):  # templates that trim contents (Gemma's) render them stripped
        contents = {mark: transform(m["content"]) for m, mark in zip(messages, marks)}
        if "".join(contents.get(p, p) for p in pieces) == rendered:
            break
    else:
        raise DSparkError(
            "the chat template changes message contents in a way dspark cannot separate from its "
            "own text; it is not supported for chat prompts"
        )
    ids = []
    for piece in pieces:
        if piece in contents:
            ids += tokenizer(contents[piece], add_special_tokens=False, split_special_tokens=True)["input_ids"]
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
    return ids
