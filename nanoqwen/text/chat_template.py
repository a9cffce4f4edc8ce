"""What a chat template writes by itself: the default system prompt of a conversation.

Some templates put a system prompt into every conversation that has none (Qwen2.5's "You are
Qwen, created by Alibaba Cloud. ..."). A chat front end shows it and lets the user replace
it, so it needs to know the text, which no config field holds: `default_system_prompt`
finds it by rendering one user message twice, alone and after a system message whose text
is a marker; what the first rendering has where the second has the marker is the default.
"""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

from nanoqwen.text.tokenizer import Tokenizer

# Texts no chat template changes, to find where it puts a message's content.
_SYSTEM_MARKER, _USER_MARKER = "nanoqwen-system-marker", "nanoqwen-user-marker"


def default_system_prompt(tokenizer: Tokenizer) -> str | None:
    """The system prompt the chat template writes into a conversation that has none, or None."""
    user = [{"role": "user", "content": _USER_MARKER}]
    try:
        alone = _render(tokenizer, user)
        marked = _render(tokenizer, [{"role": "system", "content": _SYSTEM_MARKER}, *user])
    except (ValueError, TemplateError):  # no template, or one that takes no system role
        return None
    before_user = alone[: alone.index(_USER_MARKER)]
    head, _, tail = marked[: marked.index(_USER_MARKER)].partition(_SYSTEM_MARKER)
    if len(before_user) > len(head) + len(tail) and before_user.startswith(head) and (
        before_user.endswith(tail)
    ):
        return before_user[len(head) : len(before_user) - len(tail)]
    return None


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> str:
    return tokenizer.hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
