"""The Hermes tool-call parser and the streaming tool-call splitter."""

from __future__ import annotations

import json

from engine_adapter.backends.simulated import ByteTokenizer
from server.protocol import ChatCompletionRequest
from server.tools import HermesParser, plan_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def body(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **kw}
    )


def test_hermes_parses_calls_and_leading_text() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = HermesParser().parse(text)
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me check."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert HermesParser().parse("no call here") is None
    assert HermesParser().parse("<tool_call>{broken</tool_call>") is None


def test_auto_streamer_splits_content_and_calls_across_odd_chunk_edges() -> None:
    plan = plan_tools(body(tool_choice="auto"), ByteTokenizer())
    assert plan.mode == "auto" and plan.chat_template is not None  # fallback Hermes template
    s = plan.streamer()
    pieces = ["Sure", ". <tool", '_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    deltas = []
    for i, p in enumerate(pieces):
        deltas += s.feed(p, final=i == len(pieces) - 1)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Sure. "
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Oslo"}
    assert s.called


def test_auto_streamer_passes_plain_text_through() -> None:
    s = plan_tools(body(), ByteTokenizer()).streamer()
    out = s.feed("Hello <to", final=False) + s.feed("ol> world", final=True)
    assert "".join(d["content"] for d in out) == "Hello <tool> world" and not s.called


def test_required_and_named_use_structured_output() -> None:
    req = plan_tools(body(tool_choice="required"), ByteTokenizer())
    assert req.structured is not None and req.structured.json_schema["type"] == "array"  # type: ignore[index]
    assert "maxItems" not in req.structured.json_schema  # type: ignore[operator]  # parallel calls allowed
    one = plan_tools(body(tool_choice="required", parallel_tool_calls=False), ByteTokenizer())
    assert one.structured is not None and one.structured.json_schema["maxItems"] == 1  # type: ignore[index]
    parsed = req.parse('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert parsed is not None and parsed[1][0]["function"]["name"] == "get_weather"
    named = plan_tools(body(tool_choice={"type": "function", "function": {"name": "get_weather"}}), ByteTokenizer())
    assert named.structured is not None and named.structured.json_schema == {"type": "object"}
    parsed = named.parse('{"city": "Rome"}')
    assert parsed is not None and json.loads(parsed[1][0]["function"]["arguments"]) == {"city": "Rome"}
