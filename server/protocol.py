"""OpenAI request models, ordered like the OpenAI reference; vLLM's extras
fenced off at the end of each model. Imports pydantic only.

Unknown fields are accepted and ignored (as OpenAI's servers do). Responses
are built as plain dicts in `server/render.py` (cheaper per token than
pydantic models); the response models here document them in the OpenAPI spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


# ---- shared by every API's request models (server/apis/*/protocol.py) -------
class LenientRequest(BaseModel):
    """A request body: unknown fields are accepted, kept and listed."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


def finite(v: float | None) -> float | None:
    """A field validator: NaN and infinities are refused."""
    if v is not None and not math.isfinite(v):
        raise ValueError("must be a finite number")
    return v


class _HasText(Protocol):
    text: str


def joined_text(content: str | Sequence[_HasText]) -> str:
    """A content field's text: the string itself, or its parts' joined."""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content)


def type_tag(default: str) -> Callable[[Any], str]:
    """A union's discriminator on a `type` field: the key of a dict, the
    attribute of a model, `default` where it is missing or not a string."""

    def tag(v: Any) -> str:
        t = v.get("type", default) if isinstance(v, dict) else getattr(v, "type", default)
        return t if isinstance(t, str) else default

    return tag


# ---- chat messages --------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "input_text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedToolChoiceFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format json_schema needs json_schema.schema")
        return self


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


NonNegInt = Annotated[int, Field(ge=0)]
PosInt = Annotated[int, Field(ge=1)]


class _Sampling(LenientRequest):
    """Fields shared by chat and completions requests."""

    model: str
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    max_tokens: PosInt | None = None
    n: PosInt = 1
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # --- vLLM extensions ---
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt = 0
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    request_id: str | None = None

    _finite_fields = field_validator(
        "temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty"
    )(finite)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_completion_tokens: PosInt | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # --- vLLM extensions ---
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=0)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[NonNegInt], Field(min_length=1)]
        | Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1)]
    )
    best_of: PosInt | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    suffix: str | None = None
    max_tokens: PosInt | None = 16
    response_format: ResponseFormat | None = None


class EmbeddingRequest(LenientRequest):
    model: str
    input: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[NonNegInt], Field(min_length=1)]
        | Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PosInt | None = None
    user: str | None = None
    priority: int = 0


class TokenizeRequest(LenientRequest):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(LenientRequest):
    model: str | None = None
    tokens: list[NonNegInt]


# ---- response shapes (documentation) --------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int | None = 0
    total_tokens: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelCardOut(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    slots: int | None = None  # npu-gateway: requests it runs at once (workers x --max-num-seqs)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCardOut]
