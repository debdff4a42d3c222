"""The OpenAI `/v1/completions` wire format of the remote backend, without
I/O: the request body, upstream errors as gateway errors, completions-shaped
logprobs, the merging of a network read's deltas, and the choices of a
non-streamed answer with their token counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import orjson

from engine_adapter.errors import (
    EngineError,
    GatewayError,
    InvalidRequest,
    QueueFull,
    RequestTooLarge,
    ServiceUnavailable,
)
from engine_adapter.types import EngineOutput, FinishReason, GenerationRequest, Tokenizer, TokenLogprob

UNKNOWN_TOKEN = -1  # placeholder token id: the upstream sends text, not ids
_REASONS: frozenset[str] = frozenset(("stop", "length", "abort", "error", "tool_calls"))


def completion_body(req: GenerationRequest, model: str) -> dict[str, Any]:
    s = req.sampling
    body: dict[str, Any] = {
        "model": model, "prompt": list(req.prompt_token_ids), "max_tokens": s.max_tokens, "n": s.n,
        "temperature": s.temperature, "top_p": s.top_p, "stream": req.stream,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    optional: dict[str, Any] = {
        "top_k": s.top_k or None, "min_p": s.min_p or None, "seed": s.seed, "stop": list(s.stop) or None,
        "stop_token_ids": list(s.stop_token_ids) or None, "presence_penalty": s.presence_penalty or None,
        "frequency_penalty": s.frequency_penalty or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None, "logprobs": s.logprobs,
        "ignore_eos": s.ignore_eos or None, "min_tokens": s.min_tokens or None,
        "skip_special_tokens": None if s.skip_special_tokens else False,
        "include_stop_str_in_output": s.include_stop_str_in_output or None, "priority": req.priority or None,
    }
    so = s.structured
    if so is not None:
        if so.json_schema is not None:
            schema = {"name": "schema", "schema": so.json_schema}
            optional["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif so.json_object:
            optional["response_format"] = {"type": "json_object"}
        extra = {"regex": so.regex, "choice": list(so.choice) if so.choice else None, "grammar": so.grammar}
        for key, value in extra.items():
            if value is not None:  # vLLM >= 0.10 reads structured_outputs; older ones and npu-gateway guided_*
                optional.setdefault("structured_outputs", {})[key] = value
                optional[f"guided_{key}"] = value
    body.update((k, v) for k, v in optional.items() if v is not None)
    return body


def _error_message(body: bytes) -> tuple[str, str | None]:
    try:
        err = orjson.loads(body).get("error")
        return str(err.get("message")), err.get("type")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace") or "no body", None


def status_error(status: int, body: bytes, where: str) -> GatewayError:
    msg = f"upstream {where} answered {status}: {_error_message(body)[0]}"
    if status == 429:
        return QueueFull(msg, retry_after=1)
    if status == 413:
        return RequestTooLarge(msg)
    if 400 <= status < 500 and status not in (401, 403, 404, 408):
        return InvalidRequest(msg, code="upstream_rejected")
    return ServiceUnavailable(msg, code="upstream_error", retry_after=1)


def parse_logprobs(raw: Any) -> list[TokenLogprob] | None:
    """Completions-shaped logprobs (token strings; ids are unknown)."""
    if not isinstance(raw, dict) or not raw.get("tokens"):
        return None
    n = len(raw["tokens"])
    lps = raw.get("token_logprobs") or [None] * n
    tops = raw.get("top_logprobs") or [None] * n
    return [
        TokenLogprob(
            UNKNOWN_TOKEN, str(tok), float("-inf") if lp is None else float(lp),
            tuple((UNKNOWN_TOKEN, str(t), float(v)) for t, v in (top or {}).items()),
        )
        for tok, lp, top in zip(raw["tokens"], lps, tops, strict=False)
    ]


class Merged:
    """Deltas of one choice merged into its first one (`out`)."""

    __slots__ = ("lps", "ntok", "out", "texts")

    def __init__(self, out: EngineOutput) -> None:
        self.out, self.texts, self.ntok = out, [out.text], len(out.token_ids)
        self.lps: list[TokenLogprob | None] | None = list(out.logprobs) if out.logprobs else None

    def add(self, text: str, ntok: int, lps: Sequence[TokenLogprob | None] | None) -> None:
        self.texts.append(text)
        self.ntok += ntok
        if lps:
            if self.lps is None:
                self.lps = []
            self.lps.extend(lps)

    def apply(self, to: EngineOutput | None = None) -> None:
        out = self.out if to is None else to
        out.text, out.token_ids, out.logprobs = "".join(self.texts), (UNKNOWN_TOKEN,) * self.ntok, self.lps


def whole_outputs(answer: dict[str, Any], req: GenerationRequest, tokenizer: Tokenizer) -> list[EngineOutput]:
    """The choices of a non-streamed `/v1/completions` answer, by index; the
    usage's cached tokens go on the last one (as on the stream's last delta)."""
    choices = sorted(answer["choices"], key=lambda c: int(c.get("index") or 0))
    texts = [str(c.get("text") or "") for c in choices]
    lps = [parse_logprobs(c.get("logprobs")) for c in choices]
    reasons = [finish_reason(c.get("finish_reason")) or "stop" for c in choices]
    usage = answer.get("usage") or None
    total = None if usage is None else int(usage.get("completion_tokens") or 0)
    if total is None:  # no usage: count what can be counted
        counts = [
            len(lp) if lp is not None else req.sampling.max_tokens if r == "length" else len(tokenizer.encode(t))
            for t, lp, r in zip(texts, lps, reasons, strict=True)
        ]
    else:
        counts = split_tokens(total, texts, [None if lp is None else len(lp) for lp in lps], reasons,
                              req.sampling.max_tokens)
    plen, rid = len(req.prompt_token_ids), req.request_id
    outs = [
        EngineOutput(
            request_id=rid, index=int(c.get("index") or 0), text=t, token_ids=(UNKNOWN_TOKEN,) * k, logprobs=lp,
            prompt_tokens=plen, finish_reason=r, stop_reason=c.get("stop_reason"),
        )
        for c, t, lp, r, k in zip(choices, texts, lps, reasons, counts, strict=True)
    ]
    if outs and usage is not None:
        details = usage.get("prompt_tokens_details") or {}
        outs[-1].cached_tokens = int(details.get("cached_tokens") or 0)
    return outs


def split_tokens(
    total: int, texts: Sequence[str], exact: Sequence[int | None], reasons: Sequence[str | None], max_tokens: int
) -> list[int]:
    """Per-choice token counts that add up to `total` (the upstream's
    `usage.completion_tokens`): `exact` where known (the logprobs' count),
    `max_tokens` for choices cut by length, the rest shared in proportion to
    the text length (one more for the stop token), by largest remainder; what
    is left over goes to the last choice (as the stream's last delta)."""
    counts = [k or 0 for k in exact]
    if not counts:
        return counts
    rest = total - sum(counts)
    guess = [i for i, k in enumerate(exact) if k is None]
    cut = [i for i in guess if reasons[i] == "length"]
    others = [i for i in guess if reasons[i] != "length"]
    if cut and max_tokens * len(cut) <= rest:
        for i in cut:
            counts[i] = max_tokens
        rest -= max_tokens * len(cut)
        guess = others
    if not guess:
        counts[-1] = max(0, counts[-1] + rest)
        return counts
    rest = max(0, rest)
    weights = [len(texts[i]) + 1 for i in guess]
    whole = sum(weights)
    shares = [rest * w // whole for w in weights]
    order = sorted(range(len(guess)), key=lambda j: (rest * weights[j]) % whole, reverse=True)
    for j in order[: rest - sum(shares)]:
        shares[j] += 1
    for i, k in zip(guess, shares, strict=True):
        counts[i] = k
    return counts


def finish_reason(reason: Any) -> FinishReason | None:
    if reason is None:
        return None
    return cast(FinishReason, reason) if reason in _REASONS else "stop"


def broken(msg: str, sent: bool, code: str) -> GatewayError:
    """A stream that broke: retryable before the first token, not after."""
    if sent:
        return EngineError(msg, code=code)
    return ServiceUnavailable(msg, code=code, retry_after=1)


def event_error(event: dict[str, Any], where: str, sent: bool) -> GatewayError:
    err = event.get("error") or {}
    msg = f"upstream {where}: {err.get('message') if isinstance(err, dict) else err}"
    kind = err.get("type") if isinstance(err, dict) else None
    if sent:
        return EngineError(msg, code="upstream_error")
    if kind == "rate_limit_error":
        return QueueFull(msg, retry_after=1)
    if kind == "invalid_request_error":
        return InvalidRequest(msg, code="upstream_rejected")
    return ServiceUnavailable(msg, code="upstream_error", retry_after=1)
