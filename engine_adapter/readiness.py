"""Readiness means a real generation, not a live process: one 1-token
generation (or one embedding) through the engine."""

from __future__ import annotations

import asyncio
import uuid

from engine_adapter.types import EmbeddingRequest, Engine, GenerationRequest, SamplingOptions


async def probe_once(engine: Engine, model: str) -> None:
    await engine.health()
    if getattr(engine, "relays", False):
        return  # upstream nodes: their health checks are the probe
    if engine.card.kind == "embed":
        await engine.embed(EmbeddingRequest(f"probe-{uuid.uuid4().hex}", model, ((1,),)))
        return
    eos = engine.tokenizer.eos_token_id
    req = GenerationRequest(
        request_id=f"probe-{uuid.uuid4().hex}",
        model=model,
        prompt_token_ids=(eos if eos is not None else 0,),
        sampling=SamplingOptions(max_tokens=1, temperature=0.0, ignore_eos=True),
    )
    try:
        async for _ in engine.generate(req):
            pass
    except asyncio.CancelledError:
        try:
            await engine.abort(req.request_id)
        except Exception:
            pass
        raise
