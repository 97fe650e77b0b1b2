"""Chat messages as every entry point accepts them: the roles, the content parts, one validator.

`LLM.chat`, `phloem generate` (its "messages" lines), `phloem run-batch` and the server's chat
endpoint accept the same conversations, defined once here (the server's pydantic `ChatMessage`
takes its roles and part types from these constants):

    message  = {"role": one of CHAT_ROLES, "content": content, "name"?: str}  (no other keys)
    content  = str | [ {"type": "text", "text": str}, ... ]
               (assistant messages may omit it or give null, as OpenAI's API allows)

A list of parts is rendered as the concatenation of its texts; a missing or null content as "".
A conversation is a non-empty list of messages. `render_chat` turns one into a tokenizer's
chat-template text and token ids. The engine layer imports this module; it imports nothing from
phloem.
"""

from __future__ import annotations

from typing import Any

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
CONTENT_PART_TYPES = ("text",)  # {"type": "text", "text": str}
MESSAGE_KEYS = ("role", "content", "name")
CONTENT_OPTIONAL_ROLES = ("assistant",)  # roles whose content may be missing or null


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Validate a conversation and return it as chat-template input: one
    {"role": str, "content": str} per message, content parts joined into one string.

    Does not modify `messages`.

    Raises:
        ValueError: naming the message (`messages[i]`) and the field (role, content,
            content[j], name, or an unknown key) that breaks the definition above.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            "messages must be a non-empty list of {'role': str, 'content': str | [parts]}, "
            f"got {_describe(messages)}"
        )
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        unknown = [k for k in message if k not in MESSAGE_KEYS]
        if unknown:
            raise ValueError(
                f"{where} has an unknown field {str(unknown[0])[:50]!r}; "
                f"allowed: {', '.join(MESSAGE_KEYS)}"
            )
        role = message.get("role")
        if role not in CHAT_ROLES or not isinstance(role, str):
            raise ValueError(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {_describe(role)}"
            )
        if message.get("content") is None and role not in CONTENT_OPTIONAL_ROLES:
            raise ValueError(f"{where}.content is required for role {role!r}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{where}.name must be a string, got {_describe(name)}")
        out.append({"role": role, "content": content_text(message.get("content"), where)})
    return out


def render_chat(
    tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> tuple[str, list[int]]:
    """(text, token ids) of one conversation rendered with the tokenizer's chat template; the
    rendered text is tokenized without adding special tokens again (the template has them).

    Messages are validated by `normalize_messages` (the roles and content parts every entry
    point accepts); content parts reach the template as one string.

    Raises:
        ValueError: the tokenizer has no chat template, a message breaks the shared definition
            (naming `messages[i]` and the field), or the template rejects them.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; pass plain prompts")
    messages = normalize_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # a template that rejects these messages (e.g. role order)
        raise ValueError(f"the chat template failed on these messages: {e}") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


def content_text(content: Any, where: str = "message") -> str:
    """The text of one message's content (a string, None, or a list of text parts).

    Raises:
        ValueError: naming `where`.content (or .content[j]) when the content is none of these.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(
            f"{where}.content must be a string or a list of text parts, got {_describe(content)}"
        )
    texts = []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if not isinstance(part, dict) or set(part) != {"type", "text"}:
            raise ValueError(f"{part_where} must be {{'type': 'text', 'text': str}}")
        if part["type"] not in CONTENT_PART_TYPES or not isinstance(part["type"], str):
            raise ValueError(
                f"{part_where}.type must be one of {', '.join(CONTENT_PART_TYPES)}, "
                f"got {_describe(part['type'])}"
            )
        if not isinstance(part["text"], str):
            raise ValueError(f"{part_where}.text must be a string, got {_describe(part['text'])}")
        texts.append(part["text"])
    return "".join(texts)


def _describe(value: Any) -> str:
    """A short description of a bad value for an error message (never the whole input)."""
    if isinstance(value, str):
        return repr(value[:50] + ("..." if len(value) > 50 else ""))
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return "an integer beyond 64 bits"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return type(value).__name__
