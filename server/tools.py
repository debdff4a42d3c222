"""Tool calling: which template renders the tools, how `tool_choice` is
enforced, and how the model's text is parsed into `tool_calls`.

Parsers are pluggable per model family (`PARSERS`); the default is the
Hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
`tool_choice` "required" or a named function uses structured output, so the
call is valid JSON even from a small model.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any, Protocol

import orjson

from engine_adapter.errors import InvalidRequest
from engine_adapter.types import StructuredOutput, Tokenizer
from server.protocol import ChatCompletionRequest, NamedToolChoice

ToolCalls = list[dict[str, Any]]


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


class ToolParser(Protocol):
    start: str

    def parse(self, text: str) -> tuple[str, ToolCalls] | None: ...


class HermesParser:
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, ToolCalls] | None:
        if self.start not in text:
            return None
        calls: ToolCalls = []
        for raw in self._block.findall(text):
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters", {}))))
        if not calls:
            return None
        content = text[: text.index(self.start)].strip()
        return content, calls


PARSERS: dict[str, ToolParser] = {"hermes": HermesParser()}
_FALLBACK_TEMPLATES = {"hermes": "hermes_tools.jinja"}


def _fallback_template(parser: str) -> str:
    return files("server").joinpath("templates", _FALLBACK_TEMPLATES[parser]).read_text()


@dataclass(slots=True)
class ToolStreamer:
    """Streams content until a tool call starts; then holds the rest and
    emits `delta.tool_calls` fragments when the choice ends."""

    plan: ToolPlan
    held: list[str] = field(default_factory=list)
    holding: bool = False
    pending: str = ""
    called: bool = False

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.plan.mode != "auto":
            self.held.append(text)
        elif self.holding:
            self.held.append(text)
        else:
            buf = self.pending + text
            start = self.plan.parser.start
            at = buf.find(start)
            if at >= 0:
                self.holding = True
                if buf[:at]:
                    deltas.append({"content": buf[:at]})
                self.held.append(buf[at:])
                self.pending = ""
            else:
                keep = _partial_suffix(buf, start)
                emit, self.pending = buf[: len(buf) - keep], buf[len(buf) - keep :]
                if emit:
                    deltas.append({"content": emit})
        if final:
            whole = "".join(self.held)
            parsed = self.plan.parse(whole) if whole else None
            if parsed is None:
                rest = self.pending + whole
                if rest:
                    deltas.append({"content": rest})
            else:
                content, calls = parsed
                if content and self.plan.mode != "auto":
                    deltas.append({"content": content})
                self.called = True
                for k, c in enumerate(calls):
                    fn = c["function"]
                    deltas.append(
                        {"tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                         "function": {"name": fn["name"], "arguments": ""}}]}
                    )
                    deltas.append({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
        return deltas


def _partial_suffix(buf: str, token: str) -> int:
    for n in range(min(len(token) - 1, len(buf)), 0, -1):
        if buf.endswith(token[:n]):
            return n
    return 0


@dataclass(slots=True)
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    parser: ToolParser = field(default_factory=HermesParser)
    template_tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    structured: StructuredOutput | None = None
    named: str | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)

    def parse(self, text: str) -> tuple[str, ToolCalls] | None:
        if self.mode == "auto":
            return self.parser.parse(text)
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError:
            return None
        if self.mode == "named":
            assert self.named is not None
            return "", [_call(self.named, obj)]
        if not isinstance(obj, list):
            return None
        calls = [
            _call(c["name"], c.get("parameters", {}))
            for c in obj
            if isinstance(c, dict) and isinstance(c.get("name"), str)
        ]
        return ("", calls) if calls else None


def plan_tools(body: ChatCompletionRequest, tokenizer: Tokenizer, parser_name: str = "hermes") -> ToolPlan:
    uses_tool_history = any(m.role == "tool" or m.tool_calls for m in body.messages)
    template = body.chat_template
    own = getattr(tokenizer, "chat_template", None)
    needs_fallback = (body.tools or uses_tool_history) and not (own and "tool" in own)
    if template is None and needs_fallback:
        template = _fallback_template(parser_name)
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return ToolPlan(chat_template=template)
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    choice = body.tool_choice or "auto"
    plan = ToolPlan(parser=PARSERS[parser_name], template_tools=tools, chat_template=template)
    if choice == "none":
        return plan
    if isinstance(choice, NamedToolChoice):
        names = {t.function.name: t for t in body.tools}
        tool = names.get(choice.function.name)
        if tool is None:
            raise InvalidRequest(
                f"tool_choice names `{choice.function.name}`, which is not in tools", param="tool_choice"
            )
        plan.mode, plan.named = "named", tool.function.name
        plan.structured = StructuredOutput(json_schema=tool.function.parameters or {"type": "object"})
        return plan
    if choice == "required":
        plan.mode = "required"
        plan.structured = StructuredOutput(
            json_schema={
                "type": "array",
                "minItems": 1,
                # parallel_tool_calls=false: one call at most (a small model otherwise repeats the call
                # until max_tokens: SmolLM2-135M in float32 did)
                **({} if body.parallel_tool_calls is not False else {"maxItems": 1}),
                "items": {
                    "anyOf": [
                        {
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "enum": [t.function.name]},
                                "parameters": t.function.parameters or {"type": "object"},
                            },
                            "required": ["name", "parameters"],
                        }
                        for t in body.tools
                    ]
                },
            }
        )
        return plan
    plan.mode = "auto"
    return plan
