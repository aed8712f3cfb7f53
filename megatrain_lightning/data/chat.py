"""A conversation as token ids with the loss on assistant tokens only: the tokenizer's chat template, or a prompt.

With a chat template (a Hugging Face tokenizer whose ``chat_template`` is set, e.g. any instruct model's),
the conversation is rendered by ``tokenizer.apply_chat_template``, exactly as at inference. The assistant
spans are found by rendering prefixes: the text of the turns before assistant turn k with the generation
prompt ends where that turn's content starts, and the text of the turns up to k ends where it ends. Each
span (the content and the template's end-of-turn token, e.g. ``<|im_end|>``; not the whitespace after it)
is supervised, everything else (system prompt, user turns, role headers) has label -100; every assistant
turn of a multi-turn conversation is supervised. A template that renders earlier turns differently as
the conversation grows (one that rewrites past assistant turns) is refused with the setting to change.

Without one (the byte tokenizer, a base model's tokenizer), each user turn is ``prompt_template`` with
``{query}`` replaced, a system message is prepended as its own paragraph, and an assistant turn is its
content followed by ``<eos>``, after the tokenizer's ``<bos>`` when it has one.

Pieces are tokenised one by one (every piece boundary is a token boundary). That is what makes the labels
exact; around a boundary it can differ from tokenising the whole text at once, which is harmless at the
boundaries templates have (a special token or a newline on either side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain_lightning.data.records import Conversation
from megatrain_lightning.errors import ConfigError

IGNORE_INDEX = -100  # the label value torch's cross-entropy skips


@dataclass(frozen=True)
class EncodedSample:
    """One example as token ids.

    ``ids``/``labels``: the conversation for training (labels -100 outside assistant turns), at most
    ``max_length`` tokens. ``prompt``: the tokens before the last assistant turn (what generation starts
    from in validation); ``answer``: that turn's tokens, never truncated (the reference of exact match),
    ending with ``<eos>`` or the template's end-of-turn token.
    """

    ids: list[int]
    labels: list[int]
    prompt: list[int]
    answer: list[int]

    def __len__(self) -> int:
        return len(self.ids)


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and callable(getattr(tokenizer, "apply_chat_template", None))


class ChatEncoder:
    """Turns conversations into :class:`EncodedSample` s.

    Args:
        tokenizer: a Hugging Face tokenizer or the byte tokenizer (``encode``, ``eos_token_id``).
        prompt_template: without a chat template, how a user turn becomes the prompt (``{query}`` is replaced).
        use_chat_template: None: the tokenizer's chat template when it has one; False: always
            ``prompt_template``; True: the chat template, an error when there is none.
    """

    def __init__(self, tokenizer: Any, prompt_template: str = "{query}", use_chat_template: bool | None = None) -> None:
        has = has_chat_template(tokenizer)
        if use_chat_template and not has:
            raise ConfigError(
                "data.use_chat_template=true, but the tokenizer has no chat template: set "
                "data.use_chat_template=null (use data.prompt_template) or use a tokenizer with one"
            )
        if "{query}" not in prompt_template:
            raise ConfigError(f"data.prompt_template={prompt_template!r} has no {{query}} for the question to go into")
        self.tokenizer = tokenizer
        self.prompt_template = prompt_template
        self.uses_chat_template = has if use_chat_template is None else bool(use_chat_template)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    # -- the two renderings: a list of (token ids, supervised) pieces -----------------------------------------
    def _render(self, conv: Conversation, generation_prompt: bool, where: str) -> str:
        try:
            text = self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as err:  # jinja2's TemplateError, or the template's own raise_exception()
            raise ConfigError(
                f"{where}: the tokenizer's chat template refused this conversation ({str(err).splitlines()[0]}); "
                "fix the record (e.g. roles that alternate user/assistant), or set data.use_chat_template=false"
            ) from None
        return text if isinstance(text, str) else text[0]

    def _templated(self, conv: Conversation, where: str) -> list[tuple[list[int], bool]]:
        full = self._render(conv, False, where)
        spans = []
        for k, message in enumerate(conv):
            if message["role"] != "assistant":
                continue
            before = self._render(conv[:k], True, where) if k else ""
            upto = self._render(conv[: k + 1], False, where)
            if not (upto.startswith(before) and full.startswith(upto)):
                raise ConfigError(
                    f"{where}: the tokenizer's chat template renders earlier turns differently as the conversation "
                    "grows (it rewrites past turns), so the assistant tokens cannot be told apart; set "
                    "data.use_chat_template=false (data.prompt_template instead) or use another tokenizer"
                )
            start, end = len(before), len(upto)
            while end > start and full[end - 1].isspace():  # the newline after an end-of-turn token is not learned
                end -= 1
            spans.append((start, end))
        pieces, pos = [], 0
        for start, end in spans:
            pieces += [(self._ids(full[pos:start]), False), (self._ids(full[start:end]), True)]
            pos = end
        return pieces  # what follows the last assistant turn teaches nothing

    def _plain(self, conv: Conversation) -> list[tuple[list[int], bool]]:
        bos = getattr(self.tokenizer, "bos_token_id", None)
        pieces: list[tuple[list[int], bool]] = []
        pending = [bos] if bos is not None else []
        text = ""
        for message in conv:
            if message["role"] == "system":
                text += message["content"] + "\n\n"
            elif message["role"] == "user":
                text += self.prompt_template.replace("{query}", message["content"])
            else:
                pieces.append((pending + self._ids(text), False))
                pieces.append((self._ids(message["content"]) + [self.tokenizer.eos_token_id], True))
                pending, text = [], ""
        return pieces

    def encode(self, conv: Conversation, max_length: int, where: str = "a record") -> EncodedSample | None:
        """The sample, or None when the prompt of its first assistant turn leaves no room in ``max_length``."""
        last = max(i for i, m in enumerate(conv) if m["role"] == "assistant")
        conv = conv[: last + 1]
        pieces = self._templated(conv, where) if self.uses_chat_template else self._plain(conv)
        ids: list[int] = []
        labels: list[int] = []
        for piece, supervised in pieces:
            ids += piece
            labels += piece if supervised else [IGNORE_INDEX] * len(piece)
        answer = pieces[-1][0]
        prompt = ids[: len(ids) - len(answer)]
        ids, labels = ids[:max_length], labels[:max_length]
        if all(label == IGNORE_INDEX for label in labels):
            return None
        return EncodedSample(ids, labels, prompt, answer)
