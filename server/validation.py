"""Validate OpenAI requests into frozen `GenerationRequest`s (token budget
checked against the model's context length)."""

from __future__ import annotations

import time
import uuid
from typing import Any, cast

from engine_adapter.errors import ContextLengthExceeded, InvalidRequest
from engine_adapter.types import (
    GenerationRequest,
    ModelCard,
    SamplingOptions,
    StructuredOutput,
    Tokenizer,
)
from server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat, _Sampling


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them."""
    out: list[dict[str, Any]] = []
    for m in body.messages:
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": tc.id,
                    "type": "function",
                    "function": {"name": tc.function.name, "arguments": _json_or_str(tc.function.arguments)},
                }
                for tc in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _json_or_str(s: str) -> Any:
    import orjson

    try:
        return orjson.loads(s)
    except orjson.JSONDecodeError:
        return s


def structured_from(
    fmt: ResponseFormat | None, body: _Sampling
) -> StructuredOutput | None:
    if body.guided_json is not None:
        return StructuredOutput(json_schema=body.guided_json)
    if body.guided_regex is not None:
        return StructuredOutput(regex=body.guided_regex)
    if body.guided_choice is not None:
        return StructuredOutput(choice=tuple(body.guided_choice))
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(json_object=True)
    assert fmt.json_schema is not None and fmt.json_schema.json_schema is not None
    return StructuredOutput(json_schema=fmt.json_schema.json_schema)


def _logit_bias(raw: dict[str, float] | None, vocab_hint: int | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    out = []
    for k, v in raw.items():
        try:
            tid = int(k)
        except ValueError:
            raise InvalidRequest(f"logit_bias key {k!r} is not a token id", param="logit_bias") from None
        if tid < 0 or (vocab_hint is not None and tid >= vocab_hint):
            raise InvalidRequest(f"logit_bias token id {tid} is out of range", param="logit_bias")
        out.append((tid, float(v)))
    return tuple(out)


def budget(
    prompt_len: int, requested: int | None, card: ModelCard, param: str = "max_tokens"
) -> int:
    limit = card.max_model_len
    if prompt_len >= limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {prompt_len} tokens. Please reduce the length of the prompt.",
            param="messages" if param != "max_tokens_completion" else "prompt",
        )
    if requested is None:
        return limit - prompt_len
    if prompt_len + requested > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
            f"completion). Please reduce the prompt or {param}.",
            param=param,
        )
    return requested


def sampling_options(
    body: _Sampling,
    max_tokens: int,
    max_n: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutput | None = None,
    vocab_hint: int | None = None,
) -> SamplingOptions:
    n = body.n
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise InvalidRequest("best_of other than n is not supported", param="best_of")
    if n > max_n:
        raise InvalidRequest(f"n={n} is over this server's limit of {max_n}", param="n")
    temperature = 1.0 if body.temperature is None else body.temperature
    if body.min_tokens > max_tokens:
        raise InvalidRequest(
            f"min_tokens ({body.min_tokens}) is larger than max_tokens ({max_tokens})", param="min_tokens"
        )
    return SamplingOptions(
        max_tokens=max_tokens,
        n=n,
        temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=body.stop_list(),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias=_logit_bias(body.logit_bias, vocab_hint),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        structured=structured,
    )


def deadline_after(seconds: float) -> float:
    return time.monotonic() + seconds


def chat_prompt(
    body: ChatCompletionRequest,
    tokenizer: Tokenizer,
    tools: list[dict[str, Any]] | None,
    chat_template: str | None = None,
) -> tuple[str, list[int]]:
    try:
        text = tokenizer.apply_chat_template(
            chat_messages(body),
            tools=tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            chat_template=chat_template or body.chat_template,
        )
    except Exception as e:  # jinja errors from the template: the client's input
        raise InvalidRequest(f"the chat template could not render these messages: {e}", param="messages") from e
    return text, tokenizer.encode(text, add_special_tokens=False)


def build_chat_request(
    body: ChatCompletionRequest,
    *,
    request_id: str,
    model: str,
    prompt: str,
    prompt_ids: list[int],
    card: ModelCard,
    max_n: int,
    timeout: float,
    structured: StructuredOutput | None,
    api_key_name: str | None = None,
    priority: int | None = None,
    vocab_hint: int | None = None,
) -> GenerationRequest:
    requested = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = budget(len(prompt_ids), requested, card, param)
    top = body.top_logprobs or 0
    opts = sampling_options(
        body, max_tokens, max_n, logprobs=top if body.logprobs else None,
        structured=structured, vocab_hint=vocab_hint,
    )
    return _engine_request(body, opts, prompt, prompt_ids, request_id, model, timeout, api_key_name, priority)


PromptInput = str | list[str] | list[int] | list[list[int]]


def prompt_inputs(p: PromptInput, tokenizer: Tokenizer) -> list[tuple[str | None, list[int]]]:
    """OpenAI's four prompt forms (text, texts, ids, lists of ids) as
    (text or None, token ids) pairs."""
    if isinstance(p, str):
        return [(p, tokenizer.encode(p, add_special_tokens=True))]
    out: list[tuple[str | None, list[int]]] = []
    for item in p:
        if isinstance(item, str):
            out.append((item, tokenizer.encode(item, add_special_tokens=True)))
        elif isinstance(item, int):
            return [(None, list(cast("list[int]", p)))]
        else:
            out.append((None, list(item)))
    return out


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer) -> list[tuple[str | None, list[int]]]:
    return prompt_inputs(body.prompt, tokenizer)


def build_completion_request(
    body: CompletionRequest,
    prompt: str | None,
    prompt_ids: list[int],
    *,
    request_id: str,
    model: str,
    card: ModelCard,
    max_n: int,
    timeout: float,
    api_key_name: str | None = None,
    priority: int | None = None,
    vocab_hint: int | None = None,
) -> GenerationRequest:
    if body.suffix:
        raise InvalidRequest("suffix is not supported by this model", param="suffix")
    if not prompt_ids:
        raise InvalidRequest("prompt must not be empty", param="prompt")
    if vocab_hint is not None and max(prompt_ids) >= vocab_hint:
        raise InvalidRequest("prompt holds a token id outside the vocabulary", param="prompt")
    max_tokens = budget(len(prompt_ids), body.max_tokens, card)
    structured = structured_from(body.response_format, body)
    opts = sampling_options(
        body,
        max_tokens,
        max_n,
        logprobs=body.logprobs,
        prompt_logprobs=(body.logprobs or 0) if (body.echo and body.logprobs is not None) else None,
        structured=structured,
        vocab_hint=vocab_hint,
    )
    return _engine_request(body, opts, prompt, prompt_ids, request_id, model, timeout, api_key_name, priority)


def _engine_request(
    body: _Sampling,
    opts: SamplingOptions,
    prompt: str | None,
    prompt_ids: list[int],
    request_id: str,
    model: str,
    timeout: float,
    api_key_name: str | None,
    priority: int | None,
) -> GenerationRequest:
    """A chat or completion body's engine request, its sampling settled
    (`priority`: the key's, when the caller settled it; else the body's)."""
    return GenerationRequest(
        request_id=request_id,
        model=model,
        prompt_token_ids=tuple(prompt_ids),
        prompt=prompt,
        sampling=opts,
        priority=body.priority if priority is None else priority,
        deadline=deadline_after(timeout),
        stream=bool(body.stream),
        api_key_name=api_key_name,
    )
