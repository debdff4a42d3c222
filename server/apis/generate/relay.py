"""`/generate` and `/generate_stream` for upstream nodes (server/relay_apis.py):
the translation to completions for a node that does not serve them, the
renderers of its completion chunks in vLLM's and TGI's shapes, and the
token estimates for passed-through answers (neither shape carries a usage).

A translated TGI answer has the text, the finish reason and the token
count; its tokens carry the text the node sent per chunk, with no id (-1)
and no logprob."""

from __future__ import annotations

from typing import Any

import orjson

from engine_adapter.errors import GatewayError
from engine_adapter.types import RelayCall
from server.apis.generate.protocol import TgiGenerateRequest, VllmGenerateRequest
from server.errors import tgi_error_event
from server.generation import RelayGeneration

UNKNOWN_ID = -1
_TGI_FINISH = {"length": "length", "stop": "eos_token"}


def vllm_completion(body: VllmGenerateRequest) -> dict[str, Any]:
    """vLLM's /generate fields are its sampling parameters, which
    completions takes by the same names."""
    return body.model_dump(exclude_none=True, exclude={"model", "stream"})


def tgi_completion(body: TgiGenerateRequest) -> dict[str, Any]:
    p = body.parameters
    greedy = not p.do_sample and p.temperature is None and p.top_k is None and p.top_p is None
    out: dict[str, Any] = {
        "prompt": body.inputs, "max_tokens": p.max_new_tokens, "temperature": 0.0 if greedy else p.temperature,
        "top_p": p.top_p, "top_k": p.top_k, "seed": p.seed, "stop": p.stop or None,
        "repetition_penalty": p.repetition_penalty, "frequency_penalty": p.frequency_penalty,
    }
    if p.grammar is not None:
        value = p.grammar.value
        if p.grammar.type == "regex":
            out["structured_outputs"] = {"regex": value}
            out["guided_regex"] = value
        else:
            schema = value if isinstance(value, dict) else orjson.loads(value)
            out["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    return {k: v for k, v in out.items() if v is not None}


class VllmView:
    """Completion chunks -> vLLM's `{"text": [prompt + text, ...]}` (one
    JSON object per line when streamed)."""

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt
        self.texts: dict[int, list[str]] = {}

    def head(self) -> bytes:
        return b""

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes:
        self.texts.setdefault(int(delta.get("_choice") or 0), []).append(delta.get("content") or "")
        return orjson.dumps(self.whole()) + b"\n"

    def tail(self) -> bytes:
        return b""

    def whole(self) -> dict[str, Any]:
        return {"text": [self.prompt + "".join(self.texts[i]) for i in sorted(self.texts)]}

    def failed(self, err: GatewayError) -> bytes:
        return tgi_error_event(err)[len(b"data:"):-1]


class TgiView:
    """Completion chunks -> TGI's answer, or its token events (one per
    chunk; the last one with the whole text)."""

    def __init__(self, gen: RelayGeneration, body: TgiGenerateRequest) -> None:
        self.gen = gen
        self.p = body.parameters
        self.prefix = body.inputs if self.p.return_full_text else ""
        self.text: list[str] = []
        self.index = 0
        self.reason = "length"

    def head(self) -> bytes:
        return b""

    def _details(self, tokens: int) -> dict[str, Any]:
        return {"finish_reason": self.reason, "generated_tokens": tokens, "seed": self.p.seed, "prefill": [],
                "tokens": []}

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes:
        text = delta.get("content") or ""
        if int(delta.get("_choice") or 0) != 0 or (not text and finish_reason is None):
            return b""
        self.text.append(text)
        self.index += 1
        last = finish_reason is not None
        if last:
            self.reason = "stop_sequence" if isinstance(stop_reason, str) else _TGI_FINISH.get(finish_reason or "",
                                                                                               "eos_token")
        event: dict[str, Any] = {
            "index": self.index, "token": {"id": UNKNOWN_ID, "text": text, "logprob": None, "special": not text},
            "top_tokens": None, "generated_text": self.prefix + "".join(self.text) if last else None, "details": None,
        }
        if last and self.p.details:
            event["details"] = {"finish_reason": self.reason, "generated_tokens": self.index, "seed": self.p.seed}
        return b"data:" + orjson.dumps(event) + b"\n\n"

    def tail(self) -> bytes:
        return b""

    def whole(self) -> dict[str, Any]:
        out: dict[str, Any] = {"generated_text": self.prefix + "".join(self.text)}
        if self.p.details:
            out["details"] = self._details(self.gen.completion_tokens or self.index)
        return out

    def failed(self, err: GatewayError) -> bytes:
        return tgi_error_event(err)


def _prompt_tokens(call: RelayCall) -> int:
    return len(str(call.body.get("prompt") or call.body.get("inputs") or "").encode()) // 4


def estimate_vllm(call: RelayCall, last: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens of a passed-through vLLM /generate answer:
    a token per four bytes (its last line holds every choice's whole text)."""
    lines = [line for line in last.replace(b"\0", b"\n").split(b"\n") if line.strip()]
    try:
        texts = orjson.loads(lines[-1]).get("text") or [] if lines else []
    except (ValueError, AttributeError):
        texts = []
    prompt = str(call.body.get("prompt") or "")
    made = sum(len(str(t).removeprefix(prompt).encode()) for t in texts)
    return _prompt_tokens(call), made // 4


def estimate_tgi(call: RelayCall, last: bytes) -> tuple[int, int]:
    """(prompt, completion) tokens of a passed-through TGI answer: its
    details' counts when it has them, the last token event's index, else a
    token per four bytes of the text."""
    at = last.rfind(b"data:")
    raw = last[at + 5:] if at >= 0 else last
    try:
        obj = orjson.loads(raw)
    except ValueError:
        return _prompt_tokens(call), 0
    if isinstance(obj, list):  # TGI answers a list when given one
        obj = obj[0] if obj else {}
    if not isinstance(obj, dict):
        return _prompt_tokens(call), 0
    details = obj.get("details") or {}
    length, made, index = details.get("input_length"), details.get("generated_tokens"), obj.get("index")
    prompt = length if isinstance(length, int) else _prompt_tokens(call)
    if isinstance(made, int):
        return prompt, made
    if isinstance(index, int):
        return prompt, index
    return prompt, len(str(obj.get("generated_text") or "").encode()) // 4
