"""`/generate` request models, in the two shapes its clients send. Imports
pydantic only.

- vLLM's legacy api_server (`python -m vllm.entrypoints.api_server`, vLLM
  0.23, the version vllm-ascend pins): `{"prompt", "stream", ...}` where
  every other field is a `SamplingParams` field (`max_tokens` defaults to
  16, as `SamplingParams`'s).
- TGI (and MindIE's TGI-compatible server): `{"inputs", "parameters": {...}}`.

The two are told apart by their fields (`prompt` or `inputs`); a body with
neither fails with `SHAPE_ERROR`, which the error handler answers with 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from server.protocol import PosInt, _Sampling, finite

SHAPE_ERROR = "generate_shape"


class VllmGenerateRequest(_Sampling):
    """vLLM api_server's body: the prompt, `stream`, and SamplingParams
    fields (the gateway's model name is optional: the one generation model
    when omitted)."""

    model: str | None = None  # type: ignore[assignment]
    prompt: str
    max_tokens: PosInt | None = 16


class Grammar(BaseModel):
    type: Literal["json", "regex"]
    value: dict[str, Any] | str


class TgiParameters(BaseModel):
    model_config = ConfigDict(extra="allow")

    best_of: PosInt | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    grammar: Grammar | None = None
    max_new_tokens: PosInt | None = 100
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    return_full_text: bool | None = False
    seed: Annotated[int, Field(ge=0)] | None = None
    stop: Annotated[list[str], Field(max_length=16)] = Field(default_factory=list)
    temperature: Annotated[float, Field(gt=0.0)] | None = None
    top_k: PosInt | None = None
    top_n_tokens: Annotated[int, Field(ge=0, le=20)] | None = None
    top_p: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    truncate: PosInt | None = None
    typical_p: Annotated[float, Field(gt=0.0, lt=1.0)] | None = None
    watermark: bool = False

    _finite_fields = field_validator(
        "temperature", "top_p", "repetition_penalty", "frequency_penalty", "typical_p"
    )(finite)


class TgiGenerateRequest(BaseModel):
    """TGI's body (`stream` is read by TGI's `/` route only; `/generate`
    answers whole, `/generate_stream` streams)."""

    model_config = ConfigDict(extra="allow")

    inputs: str
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: bool = False
    # --- gateway extension ---
    model: str | None = None


def _shape(v: Any) -> str | None:
    if isinstance(v, dict):
        has_prompt, has_inputs = "prompt" in v, "inputs" in v
    else:
        has_prompt, has_inputs = isinstance(v, VllmGenerateRequest), isinstance(v, TgiGenerateRequest)
    if has_prompt == has_inputs:
        return None
    return "vllm" if has_prompt else "tgi"


GenerateRequest = Annotated[
    Annotated[VllmGenerateRequest, Tag("vllm")] | Annotated[TgiGenerateRequest, Tag("tgi")],
    Discriminator(
        _shape,
        custom_error_type=SHAPE_ERROR,
        custom_error_message="a /generate body is either vLLM's api_server shape {\"prompt\": ..., ...} or "
        "TGI's {\"inputs\": ..., \"parameters\": {...}}: give exactly one of `prompt` or `inputs`",
    ),
]
