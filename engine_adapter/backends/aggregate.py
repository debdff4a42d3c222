"""Join the chunks of a streamed chat or text completion into the answer a
non-streamed call returns (for a client that does not stream, served from a
streamed upstream call so that a silent node is noticed within the read
timeout). Fields the gateway does not know are kept as the node sent them."""

from __future__ import annotations

from typing import Any

_SKIP = frozenset(("choices", "object", "usage"))


def aggregate(path: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    chat = path.endswith("/chat/completions")
    out: dict[str, Any] = {}
    for e in events:  # the first event's top-level fields (id, created, model, system_fingerprint ...)
        for k, v in e.items():
            if k not in _SKIP and k not in out:
                out[k] = v
    out["object"] = "chat.completion" if chat else "text_completion"
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for e in events:
        if e.get("usage"):
            usage = e["usage"]
        for c in e.get("choices") or ():
            i = int(c.get("index") or 0)
            acc = choices.get(i)
            if acc is None:
                acc = choices[i] = _new_choice(i, chat)
            _add_chat(acc, c) if chat else _add_text(acc, c)
    out["choices"] = [_finish(choices[i], chat) for i in sorted(choices)]
    if usage is not None:
        out["usage"] = usage
    return out


def _new_choice(i: int, chat: bool) -> dict[str, Any]:
    if chat:
        return {"index": i, "message": {"role": "assistant", "content": None}, "logprobs": None,
                "finish_reason": None, "stop_reason": None, "_text": [], "_reasoning": [], "_calls": {}}
    return {"index": i, "text": "", "logprobs": None, "finish_reason": None, "stop_reason": None, "_text": []}


def _add_common(acc: dict[str, Any], c: dict[str, Any]) -> None:
    for k, v in c.items():
        if k in ("finish_reason", "stop_reason"):
            if v is not None:
                acc[k] = v
        elif k not in ("index", "delta", "text", "logprobs") and v is not None:
            acc.setdefault(k, v)


def _add_chat(acc: dict[str, Any], c: dict[str, Any]) -> None:
    _add_common(acc, c)
    delta = c.get("delta") or {}
    msg = acc["message"]
    for k, v in delta.items():
        if k == "content":
            if v:
                acc["_text"].append(v)
        elif k in ("reasoning_content", "reasoning"):
            if v:
                acc["_reasoning"].append((k, v))
        elif k == "tool_calls":
            for tc in v or ():
                _add_call(acc["_calls"], tc)
        elif k == "role":
            msg["role"] = v or msg["role"]
        elif v is not None:
            msg.setdefault(k, v)
    lp = c.get("logprobs")
    if lp:
        if acc["logprobs"] is None:
            acc["logprobs"] = {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
        else:
            for k, v in lp.items():
                if isinstance(v, list):
                    acc["logprobs"].setdefault(k, []).extend(v)


def _add_call(calls: dict[int, dict[str, Any]], tc: dict[str, Any]) -> None:
    i = int(tc.get("index") or 0)
    call = calls.get(i)
    if call is None:
        call = calls[i] = {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
    if tc.get("id"):
        call["id"] = tc["id"]
    if tc.get("type"):
        call["type"] = tc["type"]
    fn = tc.get("function") or {}
    if fn.get("name"):
        call["function"]["name"] += fn["name"]
    if fn.get("arguments"):
        call["function"]["arguments"] += fn["arguments"]


def _add_text(acc: dict[str, Any], c: dict[str, Any]) -> None:
    _add_common(acc, c)
    if c.get("text"):
        acc["_text"].append(c["text"])
    lp = c.get("logprobs")
    if lp:
        if acc["logprobs"] is None:
            acc["logprobs"] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            acc["logprobs"][k].extend(lp.get(k) or ())


def _finish(acc: dict[str, Any], chat: bool) -> dict[str, Any]:
    text = "".join(acc.pop("_text"))
    if not chat:
        acc["text"] = text
        return acc
    msg = acc["message"]
    msg["content"] = text or None
    for key, part in acc.pop("_reasoning"):
        msg[key] = msg.get(key, "") + part
    calls = acc.pop("_calls")
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    elif chat:
        msg.setdefault("tool_calls", [])
    return acc
