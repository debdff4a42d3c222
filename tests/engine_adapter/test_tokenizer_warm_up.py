"""HfTokenizer.warm_up renders the chat template and encodes once, so the
first chat request does not pay the template's compilation."""

from __future__ import annotations

from typing import Any

from engine_adapter.backends.hf_tokenizer import HfTokenizer


class RecordingTokenizer:
    """The few calls HfTokenizer makes of a Hugging Face tokenizer."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template
        self.calls: list[tuple[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        self.calls.append(("template", (messages, kw["tokenize"], kw["add_generation_prompt"])))
        return "<|user|>" + messages[0]["content"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.calls.append(("encode", text))
        return [1, 2]


def test_warm_up_renders_the_template_and_encodes() -> None:
    tok = RecordingTokenizer("{{ messages }}")
    HfTokenizer(tok).warm_up()
    assert tok.calls == [
        ("template", ([{"role": "user", "content": "warm-up"}], False, True)),
        ("encode", "<|user|>warm-up"),
    ]


def test_warm_up_without_a_template_only_encodes() -> None:
    tok = RecordingTokenizer(None)
    HfTokenizer(tok).warm_up()
    assert tok.calls == [("encode", "warm-up")]

