"""SSE framing helpers."""

from __future__ import annotations

import orjson

from server.render import Frames, event


def test_frames_match_event_byte_for_byte() -> None:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m\"ü"}
    frames = Frames(head)
    choice = {"index": 0, "delta": {"content": "a\nb"}, "logprobs": None, "finish_reason": None}
    assert frames.choice(choice) == event({**head, "choices": [choice]})
    head["model"] = "other"
    frames.set_head(head)
    got = frames.choice(choice)
    assert got == event({**head, "choices": [choice]})
    assert orjson.loads(got[6:])["model"] == "other"
