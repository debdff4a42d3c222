"""Rendering of the Responses API: engine deltas (or a node's chat deltas,
when a Responses request was translated for it) -> a response object, or
its event stream; the finished response is stored when `store` is set."""

from __future__ import annotations

import uuid
from typing import Any

import orjson

from engine_adapter.errors import GatewayError
from server.apis.responses.protocol import ResponsesRequest
from server.errors import kind_of
from server.generation import AnyGeneration
from server.render import ChatDeltaView, Choice, Key
from server.store import ResponseStore, StoredResponse
from server.tools import ToolPlan, ToolStreamer


def _hex() -> str:
    return uuid.uuid4().hex


class ResponsesView(ChatDeltaView):
    """Engine deltas -> a response object, or its event stream; the finished
    response is stored when `store` is set."""

    def __init__(self, gen: AnyGeneration, plan: ToolPlan, body: ResponsesRequest, store: ResponseStore, owner: str,
                 items: list[dict[str, Any]], before: list[dict[str, Any]], rid: str) -> None:
        self.gen = gen
        self.plan = plan
        self.body = body
        self.store = store
        self.owner = owner
        self.items = items
        self.before = before
        self.id = rid.replace("resp-", "resp_", 1)
        # streaming state
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.msg: dict[str, Any] | None = None  # the open message item
        self.msg_text: list[str] = []  # its text so far
        self.calls: dict[int, dict[str, Any]] = {}  # open function calls by tool-call index
        self.streamer: ToolStreamer | None = plan.streamer() if plan.active else None
        self.finish_reason: str | None = None

    # ---- the response object ------------------------------------------------
    def usage(self) -> dict[str, Any]:
        g = self.gen
        return {
            "input_tokens": g.prompt_tokens, "input_tokens_details": {"cached_tokens": g.cached_tokens},
            "output_tokens": g.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": g.prompt_tokens + g.completion_tokens,
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        choice = b.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.gen.created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.gen.served_by,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "store": b.store and self.store.enabled,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled",
            "metadata": b.metadata or {}, "user": b.user, "usage": usage,
        }

    def _finished(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        called = any(it["type"] == "function_call" for it in output)
        status = "incomplete" if self.finish_reason == "length" and not called else "completed"
        resp = self.response(status, output, self.usage())
        if self.body.store and self.store.enabled:
            self.store.save(StoredResponse(
                id=self.id, owner=self.owner, created_at=self.gen.created, model=self.gen.served_by,
                response=resp, input_items=self.items, context=[*self.before, *self.items, *output],
            ))
        return resp

    # ---- not streamed ---------------------------------------------------------
    def answer(self, choices: dict[Key, Choice]) -> dict[str, Any]:
        c = next(iter(choices.values()))
        self.finish_reason = c.finish_reason
        text, calls = c.content, None
        if self.plan.active:
            parsed = self.plan.parse(text)
            if parsed is not None:
                text, calls = parsed
        output = [] if calls and not text else [_text_item(f"msg_{_hex()}", text, "completed")]
        for call in calls or []:
            fn = call["function"]
            output.append(_call_item(f"fc_{_hex()}", call["id"], fn["name"], fn["arguments"], "completed"))
        return self._finished(output)

    # ---- streamed ---------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        data = orjson.dumps({"type": kind, "sequence_number": self.seq - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def head(self) -> bytes:
        snap = self.response("in_progress", [])
        return self._event("response.created", response=snap) + self._event("response.in_progress", response=snap)

    def _finish(self, finish_reason: str, stop_reason: str | int | None) -> bytes:
        self.finish_reason = finish_reason
        return self._close()

    def whole(self) -> dict[str, Any]:
        """The response, once every delta was fed (a client that does not
        stream, served from a translated call)."""
        return self._finished(self.output)

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        head = b""
        if self.msg is None:
            self.msg = _text_item(f"msg_{_hex()}", "", "in_progress")
            self.msg["content"] = []
            self.output.append(self.msg)
            head = self._event("response.output_item.added", output_index=len(self.output) - 1, item=self.msg) + \
                self._event("response.content_part.added", item_id=self.msg["id"], output_index=len(self.output) - 1,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            self.msg_text = []
        self.msg_text.append(text)
        return head + self._event("response.output_text.delta", item_id=self.msg["id"],
                                  output_index=self.output.index(self.msg), content_index=0, delta=text, logprobs=[])

    def _tool(self, tc: dict[str, Any]) -> bytes:
        fn = tc.get("function", {})
        head = b""
        if tc.get("id") and tc.get("index", 0) not in self.calls:
            head = self._close_message()
            item = _call_item(f"fc_{_hex()}", tc["id"], fn["name"], "", "in_progress")
            self.output.append(item)
            self.calls[tc.get("index", 0)] = item
            head += self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        call = self.calls.get(tc.get("index", 0))
        args = fn.get("arguments") or ""
        if call is None or not args:
            return head
        item = call
        item["arguments"] += args
        return head + self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.output.index(item), delta=args)

    def _close_message(self) -> bytes:
        msg, self.msg = self.msg, None
        if msg is None:
            return b""
        text = "".join(self.msg_text)
        i = self.output.index(msg)
        done = _text_item(msg["id"], text, "completed")
        self.output[i] = done
        part = done["content"][0]
        return (self._event("response.output_text.done", item_id=msg["id"], output_index=i, content_index=0,
                            text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=msg["id"], output_index=i, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=i, item=done))

    def _close(self) -> bytes:
        if not self.output:  # nothing was said: an empty message, as the non-streamed answer has
            self.msg = {**_text_item(f"msg_{_hex()}", "", "in_progress"), "content": []}
            self.msg_text = []
            self.output.append(self.msg)
            added = self._event("response.output_item.added", output_index=0, item=self.msg)
            added += self._event("response.content_part.added", item_id=self.msg["id"], output_index=0,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        else:
            added = b""
        parts = [added, self._close_message()]
        for item in self.calls.values():
            i = self.output.index(item)
            item["status"] = "completed"
            parts.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                     name=item["name"], arguments=item["arguments"]))
            parts.append(self._event("response.output_item.done", output_index=i, item=item))
        self.calls = {}
        return b"".join(parts)

    def tail(self) -> bytes:
        resp = self._finished(self.output)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=resp)

    def failed(self, err: GatewayError) -> bytes:
        kind = kind_of(err)
        error = {"code": err.code or kind.type, "message": err.message}
        return self._event("response.failed", response=self.response("failed", [], self.usage(), error))


def _text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}
