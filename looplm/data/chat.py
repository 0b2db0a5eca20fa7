"""Chat templates: a chat model's messages rendered into its prompt text.

A pretrained chat model (SmolLM2-Instruct, Qwen, Gemma) was fine-tuned on conversations written in one
exact format, which its tokenizer carries as a Jinja template (HF's `chat_template`, GGUF's
`tokenizer.chat_template`). The template runs in Jinja's immutable sandbox, as transformers runs it: a
template comes with a model file a user hands us, so it may read the messages but not reach Python.
Messages are checked here (roles, string contents) before any template sees them, so a malformed request
is refused with one line whatever the template would have done with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from ..errors import UserError

ROLES = ("system", "user", "assistant")


class _TemplateRefusal(Exception):
    """raise_exception(...) called by a template (its own way to refuse a conversation)."""


def _raise(message: str) -> None:
    raise _TemplateRefusal(message)


@lru_cache(maxsize=8)
def compile_template(source: str, where: str = "chat template") -> Any:
    """The compiled template (cached by its text); UserError naming `where` when it does not parse."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    try:
        return env.from_string(source)
    except TemplateError as err:
        raise UserError(f"{where}: not a Jinja template ({err})") from None


def check_messages(messages: Any) -> list[dict[str, str]]:
    """`messages` as [{"role", "content"}] with known roles and string contents, else UserError naming the
    first bad entry (the same rule for the HTTP API and `generate --chat`)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise UserError("messages: expected a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(f"messages[{i}]: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise UserError(f"messages[{i}].role: {role!r} is not one of {', '.join(ROLES)}")
        if isinstance(content, list):    # OpenAI's content parts: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise UserError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise UserError(f"messages[{i}].content: expected a string")
        out.append({"role": role, "content": content})
    if out[-1]["role"] == "assistant":
        raise UserError("messages: the last message is the assistant's; end with a user (or system) message")
    return out


def render_chat(template: str, messages: Any, add_generation_prompt: bool,
                special: dict[str, str | None]) -> str:
    """The prompt text for `messages` through `template` (see the module docstring)."""
    from jinja2 import TemplateError

    checked = check_messages(messages)
    try:
        return compile_template(template).render(messages=checked, add_generation_prompt=add_generation_prompt,
                                                 **special)
    except _TemplateRefusal as err:
        raise UserError(f"messages: the model's chat template refuses them ({err})") from None
    except TemplateError as err:
        raise UserError(f"messages: the model's chat template failed on them ({err})") from None
