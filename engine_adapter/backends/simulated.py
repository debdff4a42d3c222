"""A simulated engine: fixed time to first token and inter-token delay, no
model. For gateway-overhead benchmarks and fast tests only; never a default.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from engine_adapter.backends.hf_tokenizer import HfTokenizer
from engine_adapter.errors import EngineDead, InvalidRequest
from engine_adapter.types import (
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    GenerationRequest,
    LoraRef,
    ModelCard,
    TokenLogprob,
)

_WORDS = (
    "The quick brown fox jumps over the lazy dog while simulated engines "
    "stream tokens at a fixed pace for gateway benchmarks"
).split()
_SPECIAL = 3  # 0 <pad>, 1 <bos>, 2 <eos>; byte b is token b + 3


class _ByteCodec:
    """One token per UTF-8 byte; a ChatML-like template. Invertible. Shaped
    like a Hugging Face tokenizer (the calls HfTokenizer makes of one)."""

    eos_token_id = 2
    chat_template: str | None = None

    def __len__(self) -> int:
        return 2048

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [b + _SPECIAL for b in text.encode("utf-8")]
        return [1, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        data = bytes(t - _SPECIAL for t in token_ids if _SPECIAL <= t < 256 + _SPECIAL)
        return data.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.decode([t]) if t >= _SPECIAL else f"<{t}>" for t in token_ids]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **kw: Any) -> str:
        parts = [f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


class ByteTokenizer(HfTokenizer):
    """The simulated engine's tokenizer: the byte codec above, seen through
    the same adapter as the tokenizer vLLM loads (so fast tests run it)."""

    def __init__(self) -> None:
        super().__init__(_ByteCodec())


@dataclass(frozen=True, slots=True)
class SimulatedConfig:
    ttft: float = 0.0
    itl: float = 0.0
    max_model_len: int = 4096
    hang: bool = False  # generate never yields (a hung engine)
    output_tokens: int | None = None  # default: max_tokens
    kind: str = "generate"
    embedding_dim: int = 8
    lora: bool = False  # takes LoRA adapters (--enable-lora); one runs the words backwards


class SimulatedEngine:
    def __init__(self, config: SimulatedConfig | None = None, name: str = "simulated") -> None:
        self.config = config or SimulatedConfig()
        self._card = ModelCard(
            max_model_len=self.config.max_model_len,
            kind="embed" if self.config.kind == "embed" else "generate",
            embedding_dim=self.config.embedding_dim if self.config.kind == "embed" else None,
            root=name,
        )
        self._tokenizer = ByteTokenizer()
        self._running: set[str] = set()
        self._dead = False
        self.started = False
        self.aborted: list[str] = []
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.loras: dict[int, LoraRef] = {}  # the adapters loaded, by id

    @property
    def card(self) -> ModelCard:
        return self._card

    @property
    def tokenizer(self) -> ByteTokenizer:
        return self._tokenizer

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    def kill(self) -> None:
        """Make every current and future call fail as a dead engine would."""
        self._dead = True

    async def health(self) -> None:
        if self._dead:
            raise EngineDead("simulated engine is dead")

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._running), unfinished=len(self._running))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._running.discard(request_id)

    async def add_lora(self, ref: LoraRef, replace: bool = False) -> None:
        if not self.config.lora:
            raise InvalidRequest("LoRA is off on this server: start it with --enable-lora", code="lora_disabled")
        self.loras[ref.id] = ref

    async def remove_lora(self, ref: LoraRef) -> None:
        self.loras.pop(ref.id, None)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        cfg = self.config
        if self._dead:
            raise EngineDead("simulated engine is dead")
        if req.lora is not None and not cfg.lora:
            raise InvalidRequest("LoRA is off on this server: start it with --enable-lora")
        words = _WORDS[::-1] if req.lora is not None else _WORDS
        self._running.add(req.request_id)
        self.prompt_tokens_total += len(req.prompt_token_ids)
        try:
            if cfg.hang:
                await asyncio.Event().wait()
            n_out = cfg.output_tokens if cfg.output_tokens is not None else req.sampling.max_tokens
            n_out = max(1, min(n_out, req.sampling.max_tokens))
            if cfg.ttft:
                await asyncio.sleep(cfg.ttft)
            for choice in range(req.sampling.n):
                for i in range(n_out):
                    if i:  # a real engine hands out one step at a time
                        await asyncio.sleep(cfg.itl)
                    if self._dead:
                        raise EngineDead("simulated engine died mid-request")
                    word = words[(i + choice) % len(words)]
                    text = word if i == 0 else " " + word
                    tid = 1000 + (i + choice) % len(_WORDS)
                    last = i == n_out - 1
                    lp = None
                    if req.sampling.logprobs is not None:
                        lp = [TokenLogprob(tid, text, -0.5, ((tid, text, -0.5),) * req.sampling.logprobs)]
                    self.generation_tokens_total += 1
                    yield EngineOutput(
                        request_id=req.request_id,
                        index=choice,
                        text=text,
                        token_ids=(tid,),
                        logprobs=lp,
                        finish_reason="length" if last else None,
                        prompt_tokens=len(req.prompt_token_ids),
                    )
        finally:
            self._running.discard(req.request_id)

    async def embed(self, req: EmbeddingRequest) -> list[list[float]]:
        if self._dead:
            raise EngineDead("simulated engine is dead")
        if self.config.hang:
            await asyncio.Event().wait()
        out = []
        dim = self.config.embedding_dim
        for ids in req.inputs:
            v = [math.sin(sum(ids) * (k + 1)) for k in range(dim)]
            norm = math.sqrt(sum(x * x for x in v)) or 1.0
            out.append([x / norm for x in v])
        return out
