"""The client APIs besides chat and completions that a node may serve:
OpenAI Responses, Anthropic Messages (and count_tokens), `/generate` in
vLLM's legacy shape and TGI's `/generate` + `/generate_stream`.

Which of them a node serves is read once from its `/openapi.json` (vLLM
serve and npu-gateway publish one; engine_adapter/routing/upstream.py), or
given with `;api=...` on `--upstream` (`API_NAMES`, or `none`). Passing
them through is engine_adapter/backends/api_relay.py's.
"""

from __future__ import annotations

from typing import Any

# API name -> the paths it needs on the node
API_PATHS: dict[str, tuple[str, ...]] = {
    "responses": ("/v1/responses",),
    "messages": ("/v1/messages",),
    "count_tokens": ("/v1/messages/count_tokens",),
    "generate": ("/generate",),  # vLLM's legacy api_server shape: {"prompt", ...} -> {"text": [...]}
    "tgi": ("/generate", "/generate_stream"),  # TGI's shape: {"inputs", "parameters"}
}
API_NAMES = tuple(API_PATHS)


def parse_apis(value: str, name: str) -> frozenset[str]:
    """`;api=responses,messages,...` (or `none`)."""
    apis = frozenset(a.strip() for a in value.split(",") if a.strip() and a.strip() != "none")
    unknown = sorted(apis - set(API_NAMES))
    if unknown:
        raise ValueError(f"upstream {name!r}: unknown api {', '.join(unknown)} (known: {', '.join(API_NAMES)}, none)")
    return apis


def apis_from_openapi(doc: Any) -> frozenset[str]:
    """The client APIs a node's OpenAPI document shows. `/generate` is vLLM's
    shape when its request schema has `prompt` (npu-gateway takes both) or,
    with no schema (vLLM's api_server reads the raw body), when there is no
    `/generate_stream`; TGI's when there is a `/generate_stream`."""
    paths = doc.get("paths") if isinstance(doc, dict) else None
    if not isinstance(paths, dict):
        return frozenset()
    posts = {p for p, ops in paths.items() if isinstance(ops, dict) and "post" in ops}
    found = {api for api, need in API_PATHS.items() if api not in ("generate", "tgi") and set(need) <= posts}
    if "/generate" in posts:
        fields = _fields(doc, paths["/generate"]["post"].get("requestBody"), 0)
        if "/generate_stream" in posts:
            found.add("tgi")
            if "prompt" in fields:
                found.add("generate")
        elif not fields or "prompt" in fields:
            found.add("generate")
    return frozenset(found)


def _fields(doc: dict[str, Any], node: Any, depth: int) -> set[str]:
    """The property names a request schema can have (through $ref, anyOf,
    oneOf, allOf and the request body's content)."""
    if depth > 8 or not isinstance(node, dict):
        return set()
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = doc
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        return _fields(doc, target, depth + 1)
    out = set(node.get("properties") or ())
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in node.get(key) or ():
            out |= _fields(doc, sub, depth + 1)
    for media in (node.get("content") or {}).values():
        out |= _fields(doc, media.get("schema") if isinstance(media, dict) else None, depth + 1)
    return out
