"""POST /v1/embeddings"""

from __future__ import annotations

import base64
import struct
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.errors import ContextLengthExceeded, InvalidRequest
from engine_adapter.types import EmbeddingRequest as EngineEmbeddingRequest
from engine_adapter.types import Tokenizer
from server.ask import RouteAsk, allowed_model, caller_of, ignore_unknown
from server.auth import AuthDep
from server.disconnect import until_disconnect
from server.generation import SERVED_BY, admit_relay, session_of
from server.protocol import EmbeddingRequest
from server.relay import relay_response
from server.routes.docs import ERRORS
from server.state import GatewayDep
from server.validation import new_id, prompt_inputs

router = APIRouter(tags=["openai"])


def _inputs(body: EmbeddingRequest, tokenizer: Tokenizer) -> list[list[int]]:
    seqs = [ids for _, ids in prompt_inputs(body.input, tokenizer)]
    vocab = tokenizer.vocab_size
    for s in seqs:
        if not s:
            raise InvalidRequest("input must not be empty", param="input")
        if max(s) >= vocab:
            raise InvalidRequest("input holds a token id outside the vocabulary", param="input")
    return seqs


@router.post("/v1/embeddings", response_model=None, responses=ERRORS)
async def create_embeddings(
    body: EmbeddingRequest, request: Request, gw: GatewayDep, principal: AuthDep
) -> Response:
    ignore_unknown(body)
    model = allowed_model(gw, principal, body.model, kind="embed")
    pool = model.pool
    if pool.relays:  # upstream nodes compute it: pass the request through
        ask = RouteAsk(await request.body(), caller=caller_of(request, gw, principal, body), request_id=new_id("embd"),
                       stream=False, want_usage=False, max_tokens=0)
        ask.path = "/v1/embeddings"
        gen = await admit_relay(request, gw, principal, model, ask, session_of(request, body.user))
        return await relay_response(request, gen)
    await until_disconnect(request, pool.ensure_started())  # an engine started on first use: ~20 s on CPU
    card = pool.card
    if body.dimensions is not None and body.dimensions != card.embedding_dim:
        raise InvalidRequest(
            f"model `{model.id}` does not support `dimensions` (its embeddings have "
            f"{card.embedding_dim} dimensions and it is not a Matryoshka model)",
            param="dimensions",
        )
    tok = pool.tokenizer
    seqs = _inputs(body, tok)
    for s in seqs:
        if len(s) > card.max_model_len:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {card.max_model_len} tokens. "
                f"However, an input has {len(s)} tokens.",
                param="input",
            )
    total = sum(len(s) for s in seqs)
    note = request.scope.setdefault("state", {})  # for the access log and the trace
    note.update(key=principal.name, model=model.id, prompt_tokens=total)
    admission = await gw.limits.admit(principal, model.id, total)
    who = caller_of(request, gw, principal, body)  # after the engine started: the deadline runs from here
    req = EngineEmbeddingRequest(
        request_id=new_id("embd"),
        model=model.id,
        inputs=tuple(tuple(s) for s in seqs),
        priority=who.priority,
        deadline=who.deadline,
        api_key_name=who.api_key_name,
    )
    try:
        got = await until_disconnect(request, pool.embed(req, session_of(request, body.user)))
    finally:
        admission.finish(total)
    note.update(completion_tokens=0, target=got.served_by if model.routed else model.id)
    vectors = got.vectors
    data: list[dict[str, Any]] = []
    for i, v in enumerate(vectors):
        emb: Any = v
        if body.encoding_format == "base64":
            emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    out = {
        "object": "list",
        "data": data,
        "model": got.served_by if model.routed else model.id,
        "usage": {"prompt_tokens": total, "total_tokens": total},
    }
    headers = admission.headers()
    if model.routed:
        headers = {**headers, SERVED_BY: got.served_by}
    return Response(orjson.dumps(out), media_type="application/json", headers=headers)
