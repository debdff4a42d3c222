"""POST /v1/completions: validate, admit through the generation core, render
text_completion JSON or chunks."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.types import EngineOutput, GenerationRequest
from server.ask import RouteAsk, allowed_model, caller_of, ignore_unknown
from server.auth import AuthDep
from server.generation import Generation, RelayGeneration, admit, json_response, session_of, stream_response
from server.protocol import CompletionRequest
from server.relay import relay_response
from server.render import DONE, Choice, CompletionLogprobs, Frames, Key, event, finish
from server.routes.docs import JSON_OR_SSE
from server.state import Gateway, GatewayDep, ServedModel
from server.validation import build_completion_request, completion_prompts, new_id

router = APIRouter(tags=["openai"])


@router.post("/v1/completions", response_model=None, responses=JSON_OR_SSE)
async def create_completion(
    body: CompletionRequest, request: Request, gw: GatewayDep, principal: AuthDep
) -> Response:
    ignore_unknown(body)
    model = allowed_model(gw, principal, body.model)
    rid = new_id("cmpl")
    ask = CompletionAsk(
        body, gw, await request.body(), caller=caller_of(request, gw, principal, body), request_id=rid,
        stream=body.stream, want_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_tokens=body.max_tokens, n=body.n,
    )
    gen = await admit(request, gw, principal, model, ask, session_of(request, body.user))
    if isinstance(gen, RelayGeneration):
        return await relay_response(request, gen)
    view = _Completions(model, gen, rid, body)
    if body.stream:
        return stream_response(gen, view.render, view.tail, gw.settings.sse_keep_alive_interval)
    return await json_response(request, gen, view.answer, each=view.collect_one)


class CompletionAsk(RouteAsk):
    """A completion request for a local engine: one engine request per
    prompt, tokenized with that engine's tokenizer."""

    path = "/v1/completions"

    def __init__(self, body: CompletionRequest, gw: Gateway, raw: bytes, **kw: Any) -> None:
        super().__init__(raw, **kw)
        self.body = body
        self.gw = gw

    def build(self, pool: Any) -> list[GenerationRequest]:
        body, s = self.body, self.gw.settings
        return [
            build_completion_request(
                body, text, ids, request_id=f"{self.request_id}-{i}", model=pool.name, card=pool.card,
                max_n=s.max_n, timeout=s.request_timeout, api_key_name=self.caller.api_key_name,
                priority=self.caller.priority, vocab_hint=pool.tokenizer.vocab_size,
            )
            for i, (text, ids) in enumerate(completion_prompts(body, pool.tokenizer))
        ]


def _prompt_text(model: ServedModel, req: GenerationRequest) -> str:
    if req.prompt is not None:
        return req.prompt
    return model.pool.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)


class _Completions:
    """Engine deltas -> a text_completion answer or its chunks. Choice
    `index` is prompt * n + the prompt's choice index."""

    def __init__(self, model: ServedModel, gen: Generation, rid: str, body: CompletionRequest) -> None:
        self.model = model
        self.gen = gen
        self.body = body
        self.n = body.n
        self.head = {"id": rid, "object": "text_completion", "created": gen.created, "model": gen.served_by}
        self.frames = Frames(self.head)
        self.lps: dict[Key, CompletionLogprobs] = {}
        self.echoed: dict[Key, str] = {}

    def _logprobs(self, key: Key) -> CompletionLogprobs | None:
        if self.body.logprobs is None:
            return None
        acc = self.lps.get(key)
        if acc is None:
            acc = self.lps[key] = CompletionLogprobs()
        return acc

    def _echo(self, p: int, key: Key, out: EngineOutput, acc: CompletionLogprobs | None) -> str:
        """The prompt text, once per choice, when `echo` is set."""
        if not self.body.echo or key in self.echoed:
            return ""
        text = self.echoed[key] = _prompt_text(self.model, self.gen.requests[p])
        if acc is not None and out.prompt_logprobs is not None:
            acc.add(out.prompt_logprobs)
        return text

    # ---- non-streamed ---------------------------------------------------
    def collect_one(self, p: int, out: EngineOutput) -> None:
        key = (p, out.index)
        acc = self._logprobs(key)
        self._echo(p, key, out, acc)
        if acc is not None and out.logprobs:
            acc.add(out.logprobs)

    def answer(self, choices: dict[Key, Choice]) -> dict[str, Any]:
        rendered = [
            {
                "index": c.index,
                "text": self.echoed.get(key, "") + c.content,
                "logprobs": self.lps[key].as_dict() if key in self.lps else None,
                "finish_reason": finish(c.finish_reason),
                "stop_reason": c.stop_reason,
            }
            for key, c in choices.items()
        ]
        return {**self.head, "model": self.gen.served_by, "choices": rendered, "usage": self.gen.usage()}

    # ---- streamed -------------------------------------------------------
    def render(self, p: int, batch: list[EngineOutput]) -> bytes | None:
        if self.head["model"] != self.gen.served_by:  # an alias fell back before the first token
            self.head["model"] = self.gen.served_by
            self.frames.set_head(self.head)
        parts: list[bytes] = []  # one write for everything that was ready together
        for out in batch:
            key = (p, out.index)
            total = self._logprobs(key)
            lp: dict[str, Any] | None = None
            acc = None if total is None else CompletionLogprobs(offset=total.offset)
            text = self._echo(p, key, out, acc) + out.text
            if acc is not None and total is not None:
                if out.logprobs:
                    acc.add(out.logprobs)
                total.offset = acc.offset
                lp = acc.as_dict()
            if not text and not out.token_ids and not out.finished and lp is None:
                continue  # a step that made no token (one chunk per token step, as vLLM's server)
            choice = {
                "index": p * self.n + out.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish(out.finish_reason),
                "stop_reason": out.stop_reason,
            }
            parts.append(self.frames.choice(choice))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def tail(self) -> bytes:
        if not (self.body.stream_options and self.body.stream_options.include_usage):
            return DONE
        return event({**self.head, "choices": [], "usage": self.gen.usage()}) + DONE
