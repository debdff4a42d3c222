"""`POST /generate` in vLLM's api_server shape and in TGI's, and TGI's
`POST /generate_stream`, through the generation core.

- vLLM (0.23 api_server): `{"text": [prompt + completion, ...]}`; streamed,
  one JSON object per line, each with every choice's text so far.
- TGI: `{"generated_text", "details"?}`; `/generate_stream` sends TGI's
  token events (`data:{"index", "token", "generated_text", "details"}`), the
  last one with the whole text. `POST /` is TGI's compat route (the one its
  `text-generation` client calls): it streams when the body says `stream`,
  else it answers `/generate`'s object in a one-item list.
- Upstream models: server/relay_apis.py and relay.py beside this one.

Errors on both paths take TGI's shape, `{"error", "error_type"}`
(server/errors.py: `TGI_KINDS`).
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.errors import InvalidRequest
from engine_adapter.types import EngineOutput, GenerationRequest, SamplingOptions, StructuredOutput, TokenLogprob
from server.apis.generate.protocol import GenerateRequest, TgiGenerateRequest, VllmGenerateRequest
from server.apis.generate.relay import TgiView, VllmView, estimate_tgi, estimate_vllm, tgi_completion, vllm_completion
from server.ask import Caller, allowed_model, caller_of
from server.auth import AuthDep, Principal
from server.errors import tgi_error_event
from server.generation import admit_local, admit_relay, json_response, prepared, session_of, stream_response
from server.relay_apis import ApiAsk, relayed_response
from server.render import Choice, Key
from server.state import Gateway, GatewayDep, ServedModel
from server.validation import budget, deadline_after, new_id, sampling_options

router = APIRouter(tags=["generate"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"description": "A TGI error: {error, error_type}", "content": {"application/json": {}}}
    for s in (400, 401, 403, 404, 405, 413, 415, 422, 429, 500, 503, 504)
}
_GENERATE = {**_ERRORS, 200: {
    "description": "JSON; with vLLM's `stream`, one JSON object per line",
    "content": {"application/json": {}, "application/x-ndjson": {}},
}}
_STREAM = {**_ERRORS, 200: {"description": "TGI's token events", "content": {"text/event-stream": {}}}}
_COMPAT = {**_ERRORS, 200: {
    "description": "`/generate`'s answer in a one-item JSON list; with `stream`, TGI's token events",
    "content": {"application/json": {}, "text/event-stream": {}},
}}


@router.post("/generate", response_model=None, responses=_GENERATE)
async def generate(body: GenerateRequest, request: Request, gw: GatewayDep, principal: AuthDep) -> Response:
    if isinstance(body, TgiGenerateRequest):
        return await _tgi(body, request, gw, principal, stream=False)
    target = allowed_model(gw, principal, body.model)
    if target.pool.relays:  # upstream nodes: passed through, or translated to completions for them
        ask = _relay_ask(request, gw, "generate", "/generate", vllm_completion(body), body.stream, body.max_tokens,
                         caller_of(request, gw, principal, body))
        relayed = await admit_relay(request, gw, principal, target, await ask, session_of(request, body.user))
        return await relayed_response(request, relayed, "/generate", VllmView(body.prompt), stream=body.stream,
                                      media_type="application/x-ndjson" if body.stream else "application/json",
                                      estimate=estimate_vllm)
    model, req = _vllm_request(body, gw, principal)
    gen = await admit_local(request, gw, principal, model, prepared(request, [req]), session_of(request, body.user))
    texts: dict[int, list[str]] = {i: [] for i in range(req.sampling.n)}
    prompt = body.prompt

    def render(_: int, batch: list[EngineOutput]) -> bytes | None:
        for out in batch:
            texts[out.index].append(out.text)
        return orjson.dumps({"text": [prompt + "".join(t) for t in texts.values()]}) + b"\n"

    def failed(err: Any) -> bytes:
        return tgi_error_event(err)[len(b"data:"):-1]  # the TGI error object, as one line

    if body.stream:
        resp = stream_response(gen, render, lambda: b"", gw.settings.sse_keep_alive_interval, on_error=failed,
                               ping=b"")
        resp.headers["content-type"] = "application/x-ndjson"
        return resp
    return await json_response(request, gen, lambda choices: {"text": [prompt + c.content for c in choices.values()]})


@router.post("/generate_stream", response_model=None, responses=_STREAM)
async def generate_stream(body: TgiGenerateRequest, request: Request, gw: GatewayDep, principal: AuthDep) -> Response:
    return await _tgi(body, request, gw, principal, stream=True)


@router.post("/", response_model=None, responses=_COMPAT, include_in_schema=True)
async def tgi_compat(body: TgiGenerateRequest, request: Request, gw: GatewayDep, principal: AuthDep) -> Response:
    """TGI's compat route, which its `text-generation` client calls: the body's
    `stream` picks `/generate_stream`, else `/generate`'s answer in a list."""
    if body.stream:
        return await _tgi(body, request, gw, principal, stream=True)
    resp = await _tgi(body, request, gw, principal, stream=False)
    if resp.status_code != 200:
        return resp
    return Response(b"[" + bytes(resp.body) + b"]", media_type="application/json", headers={
        k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")})


def _prompt_ids(model: ServedModel, text: str, param: str) -> list[int]:
    ids = model.pool.tokenizer.encode(text, add_special_tokens=True)
    if not ids:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    return ids


def _vllm_request(
    body: VllmGenerateRequest, gw: Gateway, principal: Principal
) -> tuple[ServedModel, GenerationRequest]:
    model = allowed_model(gw, principal, body.model)
    ids = _prompt_ids(model, body.prompt, "prompt")
    card, tok = model.pool.card, model.pool.tokenizer
    opts = sampling_options(body, budget(len(ids), body.max_tokens, card), gw.settings.max_n, logprobs=None,
                            vocab_hint=tok.vocab_size)
    return model, GenerationRequest(
        request_id=new_id("gen"), model=model.id, prompt_token_ids=tuple(ids), prompt=body.prompt, sampling=opts,
        priority=principal.priority_for(body.priority, "priority" in body.model_fields_set),
        deadline=deadline_after(gw.settings.request_timeout), stream=body.stream, api_key_name=principal.name,
    )


def _tgi_request(body: TgiGenerateRequest, gw: Gateway, principal: Principal, stream: bool) -> tuple[
    ServedModel, GenerationRequest
]:
    p = body.parameters
    model = allowed_model(gw, principal, body.model)
    if p.best_of is not None and p.best_of > 1:
        raise InvalidRequest("best_of is not supported", param="parameters.best_of")
    ids = _prompt_ids(model, body.inputs, "inputs")
    if p.truncate is not None:
        ids = ids[-p.truncate:]
    greedy = not p.do_sample and p.temperature is None and p.top_k is None and p.top_p is None
    structured = None
    if p.grammar is not None:
        value = p.grammar.value
        if p.grammar.type == "regex":
            if not isinstance(value, str):
                raise InvalidRequest("a regex grammar's value is a string", param="parameters.grammar.value")
            structured = StructuredOutput(regex=value)
        else:
            structured = StructuredOutput(json_schema=value if isinstance(value, dict) else _schema(value))
    # per-token details (ids, logprobs) come from the engine's logprobs
    logprobs = p.top_n_tokens if p.top_n_tokens else (0 if (stream or p.details) else None)
    opts = SamplingOptions(
        max_tokens=budget(len(ids), p.max_new_tokens, model.pool.card, "max_new_tokens"),
        temperature=0.0 if greedy else (p.temperature or 1.0),
        top_p=p.top_p or 1.0,
        top_k=p.top_k or 0,
        seed=p.seed,
        stop=tuple(p.stop),
        repetition_penalty=p.repetition_penalty or 1.0,
        frequency_penalty=p.frequency_penalty or 0.0,
        logprobs=logprobs,
        structured=structured,
    )
    return model, GenerationRequest(
        request_id=new_id("gen"), model=model.id, prompt_token_ids=tuple(ids), prompt=body.inputs, sampling=opts,
        priority=principal.priority_for(0, False), deadline=deadline_after(gw.settings.request_timeout),
        stream=stream, api_key_name=principal.name,
    )


def _schema(value: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise InvalidRequest("a json grammar's value is a JSON schema", param="parameters.grammar.value")
    return obj


def _finish(reason: str | None, stop_reason: str | int | None) -> str:
    if reason == "length":
        return "length"
    return "stop_sequence" if isinstance(stop_reason, str) else "eos_token"


def _token(lp: TokenLogprob) -> dict[str, Any]:
    return {"id": lp.token_id, "text": lp.token, "logprob": lp.logprob, "special": False}


def _top(lp: TokenLogprob) -> list[dict[str, Any]]:
    return [{"id": i, "text": t, "logprob": v, "special": False} for i, t, v in lp.top]


async def _relay_ask(
    request: Request, gw: Gateway, api: str, path: str, completion: dict[str, Any], stream: bool,
    max_tokens: int | None, caller: Caller,
) -> ApiAsk:
    return ApiAsk(
        await request.body(), gw=gw, api=api, path=path, via="/v1/completions", translate=lambda: completion,
        caller=caller, request_id=new_id("gen"), stream=stream, want_usage=False, max_tokens=max_tokens,
    )


async def _tgi(body: TgiGenerateRequest, request: Request, gw: Gateway, principal: Principal, stream: bool) -> Response:
    p = body.parameters
    target = allowed_model(gw, principal, body.model)
    if target.pool.relays:  # upstream nodes: passed through, or translated to completions for them
        path = "/generate_stream" if stream else "/generate"
        ask = _relay_ask(request, gw, "tgi", path, tgi_completion(body), stream, p.max_new_tokens,
                         caller_of(request, gw, principal))
        relayed = await admit_relay(request, gw, principal, target, await ask, session_of(request, None))
        return await relayed_response(request, relayed, path, TgiView(relayed, body), stream=stream,
                                      estimate=estimate_tgi)
    model, req = _tgi_request(body, gw, principal, stream)
    gen = await admit_local(request, gw, principal, model, prepared(request, [req]), session_of(request, None))
    prefix = body.inputs if p.return_full_text else ""
    top_n = bool(p.top_n_tokens)

    def answer(choices: dict[Key, Choice]) -> dict[str, Any]:
        c = next(iter(choices.values()))
        out: dict[str, Any] = {"generated_text": prefix + c.content}
        if p.details:
            lps = [lp for lp in c.logprobs if lp is not None]
            details: dict[str, Any] = {
                "finish_reason": _finish(c.finish_reason, c.stop_reason), "generated_tokens": c.tokens,
                "seed": p.seed, "prefill": [], "tokens": [_token(lp) for lp in lps],
            }
            if top_n:
                details["top_tokens"] = [_top(lp) for lp in lps]
            out["details"] = details
        return out

    if not stream:
        return await json_response(request, gen, answer)

    state = {"index": 0, "tokens": 0}
    text: list[str] = []

    def render(_: int, batch: list[EngineOutput]) -> bytes | None:
        parts: list[bytes] = []
        for out in batch:
            text.append(out.text)
            state["tokens"] += len(out.token_ids)
            lps = [lp for lp in out.logprobs or () if lp is not None]
            tokens = [(_token(lp), _top(lp) if top_n else None) for lp in lps]
            if not tokens and (out.text or out.finished):  # no per-token data: the delta as one token
                tid = out.token_ids[-1] if out.token_ids else 0
                tokens = [({"id": tid, "text": out.text, "logprob": 0.0, "special": not out.text}, None)]
            for k, (token, top) in enumerate(tokens):
                state["index"] += 1
                last = out.finished and k == len(tokens) - 1
                event: dict[str, Any] = {
                    "index": state["index"], "token": token, "top_tokens": top,
                    "generated_text": prefix + "".join(text) if last else None, "details": None,
                }
                if last and p.details:
                    event["details"] = {"finish_reason": _finish(out.finish_reason, out.stop_reason),
                                        "generated_tokens": state["tokens"], "seed": p.seed,
                                        "input_length": len(req.prompt_token_ids)}
                parts.append(b"data:" + orjson.dumps(event) + b"\n\n")
        return b"".join(parts) or None

    return stream_response(gen, render, lambda: b"", gw.settings.sse_keep_alive_interval, on_error=tgi_error_event)
