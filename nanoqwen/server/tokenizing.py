"""Prompts and conversations into token ids, with each request's cost bounded first.

A prompt arrives as text, token ids or chat messages; the engine wants checked token ids
(`EncodedPrompt`). Tokenizing is the one piece of a request's work done before it is
queued, on the handler thread, so it is bounded before it starts: text longer than
`MAX_PROMPT_BYTES_PER_TOKEN` bytes per token of context cannot fit, and is refused from
its length alone. Every refusal for size carries OpenAI's code `context_length_exceeded`
(`context_too_long`), which clients read to trim a conversation. Messages are checked
role by role; `developer`, OpenAI's newer name for `system`, is rendered as `system`, and
a role of the model's own (vLLM's custom roles) is passed to the template as it is,
unless the template leaves it out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2

from nanoqwen.engine import EncodedPrompt, LLMEngine, Prompt, PromptTooLong
from nanoqwen.server.protocol import (
    APIError,
    GenerationOptions,
    bad_request,
    checked_field,
    is_int,
)

# A token is a few bytes of text: about 4 in English prose or code, 3 to 6 in Chinese. No
# text that fits the context comes near this many per token, so a longer prompt is refused
# from its length alone, before the tokenizer spends seconds on it.
MAX_PROMPT_BYTES_PER_TOKEN = 16
# The roles a message may have, and the one the chat template renders it as: `developer` is
# OpenAI's newer name for `system`, which is all the templates know.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
# Any other role goes to the template as it is (vLLM's custom roles): a name, no markup.
CUSTOM_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def context_too_long(message: str, param: str) -> APIError:
    """A 400 for a request that cannot fit the model's context, with the code OpenAI gives it
    (a chat client reads it to offer dropping the oldest turns)."""
    return APIError(400, message, param=param, code="context_length_exceeded")


def check_context(prompts: list[EncodedPrompt], options: GenerationOptions,
                  max_model_len: int) -> None:
    """A request that asks for more tokens than the context leaves after a prompt is
    refused (as vLLM and SGLang do); one that leaves max_tokens out gets what is left."""
    if options.max_tokens is None:
        return
    name, asked = options.max_tokens
    for prompt in prompts:
        if len(prompt.token_ids) + asked > max_model_len:
            raise context_too_long(
                f"{name} is too large: {asked}. This model's context is {max_model_len} tokens "
                f"and the prompt has {len(prompt.token_ids)} ({asked} > {max_model_len} - "
                f"{len(prompt.token_ids)})", name,
            )


MessageExtras = Callable[[dict[str, Any], str], dict[str, Any]]


def parse_messages(
    body: dict[str, Any], extras: MessageExtras | None = None
) -> list[dict[str, Any]]:
    """The conversation, each message's role and text checked; `extras(message, param)`
    adds fields a template reads besides them (tool calls: `tools.tool_fields`)."""
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    parsed = [_parse_message(message, f"messages[{i}]") for i, message in enumerate(messages)]
    if extras is not None:
        for i, (message, raw) in enumerate(zip(parsed, messages)):
            message.update(extras(raw, f"messages[{i}]"))
    return parsed


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat is rendered besides its messages."""

    enable_thinking: bool | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # end with the assistant's turn header
    continue_final_message: bool = False  # end inside the last (assistant) message: a prefill


def parse_template_options(
    body: dict[str, Any], messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> TemplateOptions:
    """vLLM's `add_generation_prompt` and `continue_final_message` (an assistant prefill:
    the reply continues the last message's text), and Qwen3's `enable_thinking`."""
    continue_final = checked_field(body, "continue_final_message", bool, "a boolean", False)
    add_prompt = checked_field(body, "add_generation_prompt", bool, "a boolean", not continue_final)
    if continue_final and add_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          "continue_final_message")
    return TemplateOptions(parse_enable_thinking(body), tools, add_prompt, continue_final)


def parse_enable_thinking(body: dict[str, Any]) -> bool | None:
    """Qwen3's switch, passed as vLLM does: `chat_template_kwargs: {"enable_thinking": false}`."""
    template_kwargs = checked_field(body, "chat_template_kwargs", dict, "an object", {})
    return checked_field(
        template_kwargs, "enable_thinking", bool, "a boolean", None,
        "chat_template_kwargs.enable_thinking",
    )


def parse_prompts(body: dict[str, Any], name: str = "prompt") -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    prompt = body.get(name)
    if prompt is None:
        raise bad_request(f"{name} is required", name)
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(item, str) for item in prompt):
            return list(prompt)
        if all(is_int(item) for item in prompt):
            return [prompt]
        if all(isinstance(item, list) and all(map(is_int, item)) for item in prompt):
            return list(prompt)
    raise bad_request(
        f"{name} must be a string, a list of strings, a list of token ids or a list of them",
        name,
    )


def check_text_size(size: int, max_model_len: int, param: str) -> None:
    """A 400 for text of `size` bytes that cannot fit the context, without tokenizing it."""
    limit = max_model_len * MAX_PROMPT_BYTES_PER_TOKEN
    if size > limit:
        raise context_too_long(
            f"{param} is too long: {size} bytes of text cannot fit this model's context of "
            f"{max_model_len} tokens (the limit is {limit} bytes)", param,
        )


def encode_prompts(engine: LLMEngine, prompts: list[Prompt], param: str) -> list[EncodedPrompt]:
    """Every prompt's token ids, checked to fit the engine: all of them, or a 400. The
    engine thread takes them as they are, without tokenizing or checking them again."""
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text_size(len(prompt.encode()), engine.max_model_len, param)
    try:
        return [engine.encode_prompt(prompt) for prompt in prompts]
    except PromptTooLong as error:
        raise context_too_long(str(error), param) from error
    except ValueError as error:
        raise bad_request(str(error), param) from error


def render_chat(
    engine: LLMEngine, messages: list[dict[str, Any]], options: TemplateOptions,
    param: str = "messages",
) -> list[int]:
    """The conversation's token ids, through the model's template; one too long to fit
    the context (told from its size as JSON) is refused before the template sees it.
    `param` is the request field the conversation came from."""
    conversation = json.dumps([messages, options.tools], ensure_ascii=False).encode()
    check_text_size(len(conversation), engine.max_model_len, param)
    try:
        token_ids = engine.tokenizer.apply_chat_template(
            messages, options.enable_thinking, options.tools, options.add_generation_prompt,
            options.continue_final_message,
        )
    # The template itself refused (roles out of order), or transformers did (a prefill it
    # cannot find in the rendered text).
    except (jinja2.TemplateError, ValueError) as error:
        raise bad_request(f"cannot apply the chat template: {error}", param) from error
    _check_custom_roles(engine, messages, token_ids)
    return token_ids


def _check_custom_roles(
    engine: LLMEngine, messages: list[dict[str, Any]], token_ids: list[int]
) -> None:
    """A 400 for a message of a role of its own that the template left out: templates
    skip the roles they don't know (Qwen's do), and a reply to a conversation missing a
    message is not what the client asked for."""
    custom = [(i, m) for i, m in enumerate(messages) if m["role"] not in ROLES and m["content"]]
    if not custom:
        return
    rendered = engine.tokenizer.decode(token_ids, skip_special_tokens=False)
    for index, message in custom:
        if message["content"] not in rendered:
            raise bad_request(f"this model's chat template leaves out messages with the role "
                              f"{message['role']!r}", f"messages[{index}].role")


def _parse_message(message: object, param: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    # A template writes a role into the prompt as it is: a role of its own is a name, so
    # that it cannot end the turn header early and start a turn of another role.
    if not isinstance(role, str) or not (role in ROLES or CUSTOM_ROLE.fullmatch(role)):
        raise bad_request(f"{param}.role must be one of {', '.join(ROLES)}, or a role of the "
                          f"model's own (1-64 letters, digits, _, - or .), got {role!r}",
                          f"{param}.role")
    content = _message_text(message.get("content"), f"{param}.content")
    return {"role": ROLES.get(role, role), "content": content}


def _message_text(content: object, param: str) -> str:
    if content is None:  # an assistant turn that only called tools
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    raise bad_request(f"{param} must be a string or a list of text parts", param)
