"""One definition of a chat message: `normalize_messages` (LLM.chat, phloem generate) and the
server's pydantic `ChatMessage` (the chat endpoint, phloem run-batch) accept the same ones."""

from __future__ import annotations

import pytest

from phloem.chat_messages import CHAT_ROLES, normalize_messages

MESSAGES = [
    ({"role": "user", "content": "hi"}, "hi"),
    ({"role": "developer", "content": "be brief"}, "be brief"),
    (
        {"role": "tool", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        "ab",
    ),
    ({"role": "system", "content": []}, ""),
    ({"role": "assistant", "content": None}, ""),
    ({"role": "assistant"}, ""),
    ({"role": "user", "content": "x", "name": "ann"}, "x"),
    ({"role": "user"}, None),
    ({"role": "robot", "content": "x"}, None),
    ({"role": 1, "content": "x"}, None),
    ({"role": "user", "content": 5}, None),
    ({"role": "user", "content": [{"type": "image_url", "text": "x"}]}, None),
    ({"role": "user", "content": [{"type": "text", "text": 1}]}, None),
    ({"role": "user", "content": [{"type": "text"}]}, None),
    ({"role": "user", "content": ["plain"]}, None),
    ({"role": "user", "content": "x", "name": 3}, None),
    ({"role": "user", "content": "x", "tool_calls": []}, None),
    ("user: hi", None),
]


@pytest.mark.parametrize("message, text", MESSAGES)
def test_normalize_and_the_server_model_agree(message, text):
    from pydantic import ValidationError

    from phloem.entrypoints.openai.protocol import ChatMessage

    try:
        parsed = ChatMessage.model_validate(message)
        server_text: str | None = parsed.text()
    except ValidationError:
        server_text = None
    try:
        local = normalize_messages([message])
        local_text: str | None = local[0]["content"]
        assert local[0]["role"] in CHAT_ROLES
    except ValueError:
        local_text = None
    assert local_text == server_text == text


def test_errors_name_the_message_and_field():
    good = {"role": "user", "content": "hi"}
    with pytest.raises(ValueError, match=r"^messages\[1\]\.role must be one of system, developer"):
        normalize_messages([good, {"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"^messages\[0\]\.content\[1\]\.text must be a string"):
        normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                        {"type": "text", "text": None}]}])  # fmt: skip
    with pytest.raises(ValueError, match="non-empty list"):
        normalize_messages([])
    with pytest.raises(ValueError, match="non-empty list"):
        normalize_messages(None)
