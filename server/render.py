"""Engine deltas -> OpenAI response and chunk dicts; `ChatDeltaView`, the
base of the APIs that render chat deltas in their own event stream; and the
server-sent events framing of every stream (`event`, `Frames`, `DONE`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from engine_adapter.types import EngineOutput, TokenLogprob

if TYPE_CHECKING:
    from server.tools import ToolStreamer

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer this response
}


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Frames:
    """Chunk events with a fixed head (id, object, created, model) encoded
    once: `choice(c)` is `event({**head, "choices": [c]})`, byte for byte."""

    __slots__ = ("_prefix",)

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = b""
        self.set_head(head)

    def set_head(self, head: dict[str, Any]) -> None:
        self._prefix = b"data: " + orjson.dumps(head)[:-1] + b',"choices":['

    def choice(self, c: dict[str, Any]) -> bytes:
        return self._prefix + orjson.dumps(c) + b"]}\n\n"


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def chat_logprobs(lps: Sequence[TokenLogprob | None]) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        if lp is None:
            continue
        out.append(
            {
                "token": lp.token,
                "logprob": max(lp.logprob, -9999.0),
                "bytes": _bytes(lp.token),
                "top_logprobs": [
                    {"token": t, "logprob": max(v, -9999.0), "bytes": _bytes(t)} for _, t, v in lp.top
                ],
            }
        )
    return out


@dataclass(slots=True)
class CompletionLogprobs:
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0

    def add(self, lps: Sequence[TokenLogprob | None]) -> None:
        for lp in lps:
            if lp is None:  # the first prompt token has no logprob
                self.tokens.append("")
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                self.text_offset.append(self.offset)
                continue
            self.tokens.append(lp.token)
            self.token_logprobs.append(max(lp.logprob, -9999.0))
            self.top_logprobs.append({t: max(v, -9999.0) for _, t, v in lp.top})
            self.text_offset.append(self.offset)
            self.offset += len(lp.token)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


Key = tuple[int, int]  # a choice's (prompt, choice index)


@dataclass(slots=True)
class Choice:
    """Accumulates one choice of a non-streamed response."""

    index: int
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)

    def add(self, out: EngineOutput) -> None:
        if out.text:
            self.text.append(out.text)
        self.tokens += len(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finish_reason is not None:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason

    @property
    def content(self) -> str:
        return "".join(self.text)


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u


def finish(reason: str | None) -> str | None:
    if reason in ("abort", "error", "repetition"):
        return "stop"
    return reason


class ChatDeltaView(ABC):
    """Renders chat deltas in another API's event stream (Anthropic
    Messages, Responses): an engine's text through the tool streamer
    (`render`), or a node's chat chunk when the request was translated for
    it (`feed`). A subclass writes a text delta (`_text`), a tool-call delta
    (`_tool`) and the end of the answer (`_finish`)."""

    streamer: ToolStreamer | None = None

    def render(self, _: int, batch: list[EngineOutput]) -> bytes | None:
        parts: list[bytes] = []
        for out in batch:
            deltas = [{"content": out.text}] if self.streamer is None else self.streamer.feed(out.text,
                                                                                              final=out.finished)
            for d in deltas:
                parts.append(self.feed(d, None, None))
            if out.finished:
                parts.append(self.feed({}, out.finish_reason, out.stop_reason))
        return b"".join(parts) or None

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes:
        """One chat delta: its text, its tool calls, and the end if it has a finish reason."""
        parts = []
        if delta.get("content"):
            parts.append(self._text(delta["content"]))
        for tc in delta.get("tool_calls") or ():
            parts.append(self._tool(tc))
        if finish_reason is not None:
            parts.append(self._finish(finish_reason, stop_reason))
        return b"".join(parts)

    @abstractmethod
    def _text(self, text: str) -> bytes: ...

    @abstractmethod
    def _tool(self, tc: dict[str, Any]) -> bytes: ...

    @abstractmethod
    def _finish(self, finish_reason: str, stop_reason: str | int | None) -> bytes: ...
