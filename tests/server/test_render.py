"""server/render.py on its own: choices, usage, logprobs, finish reasons,
and the chat-delta view base shared by Messages and Responses."""

from __future__ import annotations

from typing import Any

from engine_adapter.types import EngineOutput, TokenLogprob
from server.render import ChatDeltaView, Choice, CompletionLogprobs, chat_logprobs, finish, usage


def test_a_choice_accumulates_text_tokens_and_its_finish() -> None:
    c = Choice(2)
    c.add(EngineOutput(request_id="r", text="Hel", token_ids=(1, 2)))
    c.add(EngineOutput(request_id="r", text="", token_ids=()))
    c.add(EngineOutput(request_id="r", text="lo", token_ids=(3,), finish_reason="stop", stop_reason="</s>"))
    assert (c.content, c.tokens, c.finish_reason, c.stop_reason, c.index) == ("Hello", 3, "stop", "</s>", 2)


def test_usage_names_cached_tokens_only_when_there_are_some() -> None:
    assert usage(5, 2) == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert usage(5, 2, 4)["prompt_tokens_details"] == {"cached_tokens": 4}


def test_finish_reasons_a_client_knows() -> None:
    assert [finish(r) for r in ("abort", "error", "repetition", "stop", "length", None)] == [
        "stop", "stop", "stop", "stop", "length", None]


def test_logprobs_clamp_minus_infinity_and_skip_the_missing_first() -> None:
    lp = TokenLogprob(token_id=7, token="é", logprob=float("-inf"), top=((7, "é", -1.0), (8, "e", float("-inf"))))
    (chat,) = chat_logprobs([None, lp])
    assert chat["logprob"] == -9999.0 and chat["bytes"] == [195, 169]
    assert [t["logprob"] for t in chat["top_logprobs"]] == [-1.0, -9999.0]
    comp = CompletionLogprobs()
    comp.add([None, lp, TokenLogprob(token_id=9, token="ab", logprob=-0.5, top=())])
    assert comp.as_dict() == {"tokens": ["", "é", "ab"], "token_logprobs": [None, -9999.0, -0.5],
                              "top_logprobs": [None, {"é": -1.0, "e": -9999.0}, {}], "text_offset": [0, 0, 1]}


class Events(ChatDeltaView):
    """Writes each call as text, to show what the base sent where."""

    def __init__(self, streamer: Any = None) -> None:
        self.streamer = streamer

    def _text(self, text: str) -> bytes:
        return f"T({text})".encode()

    def _tool(self, tc: dict[str, Any]) -> bytes:
        return f"C({tc['function']['name']})".encode()

    def _finish(self, finish_reason: str, stop_reason: str | int | None) -> bytes:
        return f"F({finish_reason},{stop_reason})".encode()


class Streamer:
    """A tool streamer that turns the text `call` into a tool call."""

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        if text == "call":
            return [{"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]}]
        return [{"content": text}]


def test_the_delta_view_base_feeds_text_tool_calls_and_the_finish() -> None:
    v = Events()
    assert v.feed({"content": "hi"}, None, None) == b"T(hi)"
    assert v.feed({"content": ""}, None, None) == b""
    assert v.feed({"tool_calls": [{"function": {"name": "f"}}, {"function": {"name": "g"}}]}, "tool_calls", None) \
        == b"C(f)C(g)F(tool_calls,None)"
    batch = [EngineOutput(request_id="r", text="a"), EngineOutput(request_id="r", text="b", finish_reason="stop",
                                                                  stop_reason=7)]
    assert v.render(0, batch) == b"T(a)T(b)F(stop,7)"
    assert v.render(0, [EngineOutput(request_id="r", text="")]) is None
    assert Events(Streamer()).render(0, [EngineOutput(request_id="r", text="call")]) == b"C(f)"
