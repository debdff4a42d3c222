"""The app on a real uvicorn socket with scripted simulated engines, for the
official SDKs (openai, anthropic) and raw HTTP clients of the other APIs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from support import free_port, wait_until

from engine_adapter.backends.simulated import SimulatedConfig, SimulatedEngine
from engine_adapter.pool import WorkerPool
from engine_adapter.types import EngineOutput, FinishReason, GenerationRequest, TokenLogprob
from server.app import create_app
from server.settings import Settings

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SUNNY = "It is sunny in Paris."
DEFAULT = "The quick brown fox jumps over the lazy dog."


class ScriptedEngine(SimulatedEngine):
    """Answers by script, a few characters per token: after a tool result,
    the weather; asked about the weather, a Hermes tool call; else DEFAULT.
    Honours max_tokens and stop strings, and records every prompt."""

    def __init__(self, cfg: SimulatedConfig, prompts: list[str]) -> None:
        super().__init__(cfg, name="sim")
        self.prompts = prompts

    @staticmethod
    def script(prompt: str) -> str:
        last = prompt.rsplit("<|im_start|>", 2)[-2] if "<|im_start|>" in prompt else prompt
        if last.startswith("tool"):
            return SUNNY
        if "weather" in last.lower():
            return TOOL_CALL
        return DEFAULT

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        prompt = req.prompt or ""
        self.prompts.append(prompt)
        self._running.add(req.request_id)
        try:
            text = self.script(prompt)
            finish: FinishReason = "stop"
            stop_reason: str | None = None
            for s in req.sampling.stop:
                at = text.find(s)
                if at >= 0:
                    text, stop_reason = text[:at], s
            pieces = [text[i:i + 4] for i in range(0, len(text), 4)] or [""]
            if len(pieces) > req.sampling.max_tokens:
                pieces, finish, stop_reason = pieces[: req.sampling.max_tokens], "length", None
            for i, piece in enumerate(pieces):
                if i:
                    await asyncio.sleep(self.config.itl)
                last = i == len(pieces) - 1
                lp = None
                if req.sampling.logprobs is not None:
                    lp = [TokenLogprob(1000 + i, piece, -0.25, ((1000 + i, piece, -0.25),) * req.sampling.logprobs)]
                yield EngineOutput(
                    request_id=req.request_id, text=piece, token_ids=(1000 + i,), logprobs=lp,
                    finish_reason=finish if last else None, stop_reason=stop_reason if last else None,
                    prompt_tokens=len(req.prompt_token_ids),
                )
        finally:
            self._running.discard(req.request_id)


@dataclass
class Live:
    url: str
    app: Any
    pool: WorkerPool
    prompts: list[str] = field(default_factory=list)


@asynccontextmanager
async def serve_scripted(
    settings: Settings | None = None, itl: float = 0.0, **pool_kw: Any
) -> AsyncIterator[Live]:
    """One generation model `sim` (also `sim-alias`) of scripted engines on
    a real uvicorn server on 127.0.0.1."""
    prompts: list[str] = []
    cfg = SimulatedConfig(max_model_len=4096, itl=itl)
    pool = WorkerPool("sim", lambda i: ScriptedEngine(cfg, prompts), readiness_interval=60, **pool_kw)
    app = create_app(settings or Settings(), pools=[(pool, ("sim", "sim-alias"), "sim")])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    try:
        await wait_until(lambda: server.started, timeout=60, what="uvicorn to start")
        yield Live(f"http://127.0.0.1:{port}", app, pool, prompts)
    finally:
        server.should_exit = True
        await task
