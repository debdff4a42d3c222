"""The types that cross the line between server/ and engine_adapter/.

The HTTP layer validates a request into a frozen `GenerationRequest`; engines
accept only that type and answer with a stream of `EngineOutput` deltas.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "abort", "error", "tool_calls"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Constrained decoding: exactly one of the fields is set."""

    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: sampled token + top k
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None


@dataclass(frozen=True, slots=True)
class LoraRef:
    """A LoRA adapter a request runs with (engine_adapter/lora.py): its
    served name, the engine-wide id vLLM keys it by, and its folder."""

    name: str
    id: int
    path: str


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingOptions
    prompt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() value; None: no deadline
    api_key_name: str | None = None
    ttft_deadline: float | None = None  # time.monotonic() its first token is due (admission only)
    # False: the client takes the whole answer at once; an engine may then
    # produce it in one piece (the remote backend makes one non-streamed call)
    stream: bool = True
    # the request span's W3C trace context (traceparent, tracestate), for an
    # engine that traces itself (vLLM with --engine-arg otlp_traces_endpoint=...)
    trace_headers: tuple[tuple[str, str], ...] = ()
    lora: LoraRef | None = None  # run with this LoRA adapter on the base model


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    request_id: str
    model: str
    inputs: tuple[tuple[int, ...], ...]
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None
    api_key_name: str | None = None


@dataclass(frozen=True, slots=True)
class RelayCall:
    """A request passed through to an upstream node: the client's endpoint
    and JSON body, as sent (only `model` is set per node)."""

    request_id: str
    model: str  # the served name of the target (a router renames it)
    path: str  # e.g. "/v1/chat/completions"
    body: dict[str, Any]
    stream: bool = False  # the client streams
    want_usage: bool = False  # the client asked for the stream's usage chunk
    priority: int = 0
    deadline: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    api_key_name: str | None = None
    headers: tuple[tuple[str, str], ...] = ()  # sent upstream as well (the gateway's X-Request-Id)
    ttft_deadline: float | None = None  # time.monotonic() its first token is due (admission only)
    node_model: str | None = None  # the model id sent to the node (an adapter's); None: the upstream's own


@dataclass(frozen=True, slots=True)
class RelayUsage:
    """The usage a node reported for a passed-through request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_dict(cls, usage: Any) -> RelayUsage | None:
        """OpenAI's chat/completions usage, the Responses API's
        (`input_tokens`, `output_tokens`, `input_tokens_details`) or
        Anthropic's (`input_tokens` without the cache reads)."""
        if not isinstance(usage, dict):
            return None
        if "input_tokens" in usage and "prompt_tokens" not in usage:
            try:
                if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:  # Anthropic
                    cached = int(usage.get("cache_read_input_tokens") or 0)
                    fresh = int(usage.get("input_tokens") or 0) + int(usage.get("cache_creation_input_tokens") or 0)
                    return cls(fresh + cached, int(usage.get("output_tokens") or 0), cached)
                details = usage.get("input_tokens_details") or {}
                return cls(int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0),
                           int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0)
            except (TypeError, ValueError):
                return None
        details = usage.get("prompt_tokens_details") or {}
        try:
            return cls(
                int(usage.get("prompt_tokens") or 0),
                int(usage.get("completion_tokens") or 0),
                int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
            )
        except (TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Embedded:
    """An embedding answer and the served model that computed it."""

    served_by: str
    vectors: list[list[float]]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, text, logprob)


@dataclass(frozen=True, slots=True)
class EngineTimings:
    """An engine's own account of one finished request, in seconds: waiting
    in its scheduler's queue, the prefill (scheduled to first token), the
    decode (first to last token) and the whole inference (scheduled to last
    token). vLLM's names: gen_ai.latency.time_in_queue,
    time_in_model_prefill, time_in_model_decode, time_in_model_inference."""

    queued: float
    prefill: float
    decode: float
    inference: float


@dataclass(slots=True)
class EngineOutput:
    """One delta of one choice (`index`) of one request."""

    request_id: str
    index: int = 0
    text: str = ""
    token_ids: Sequence[int] = ()
    logprobs: Sequence[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: Sequence[TokenLogprob | None] | None = None
    timings: EngineTimings | None = None  # on a finished choice's last output, when the engine keeps them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    unfinished: int = 0  # requests the engine holds right now (live count)


@runtime_checkable
class Tokenizer(Protocol):
    """What the HTTP layer needs of a model's tokenizer."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What the engine knows about the model it serves."""

    max_model_len: int
    kind: Literal["generate", "embed"] = "generate"
    embedding_dim: int | None = None
    root: str = ""


@runtime_checkable
class Engine(Protocol):
    """One engine instance (one vLLM AsyncLLM, one upstream, one simulation)."""

    @property
    def card(self) -> ModelCard: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]: ...

    async def embed(self, req: EmbeddingRequest) -> list[list[float]]: ...

    async def abort(self, request_id: str) -> None: ...

    async def health(self) -> None:
        """Raise `EngineDead` if the engine cannot serve."""
        ...

    def stats(self) -> EngineStats: ...
