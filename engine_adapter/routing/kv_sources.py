"""Where the kv-events policy's KV events come from: the local vLLM engines
of a pool (private IPC sockets, kv_event_endpoints)
or an upstream's nodes (`;kv-events=PUB[|REPLAY],...` and `;kv-tokenizer=`,
routing/upstream.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine_adapter.routing.kv_events import KvEventsPolicy, KvSource
from engine_adapter.routing.policies import make_policy

logger = logging.getLogger(__name__)


def kv_event_endpoints(folder: str, index: int) -> tuple[str, str]:
    """(PUB, replay ROUTER) endpoints of engine `index`'s KV events: IPC
    sockets in a private folder, bound by the engine, one pair per engine;
    a restarted engine binds the same pair again."""
    return f"ipc://{folder}/engine-{index}.pub", f"ipc://{folder}/engine-{index}.replay"


def engine_description(engine: Any) -> tuple[int, str] | None:
    """A started vLLM engine's effective (block size, prefix caching hash
    algorithm), read from its config (None: not started, or not vLLM)."""
    cache = getattr(getattr(getattr(engine, "llm", None), "vllm_config", None), "cache_config", None)
    size = getattr(cache, "block_size", None)
    if not isinstance(size, int) or size < 1:
        return None
    return size, str(getattr(cache, "prefix_caching_hash_algo", "sha256"))


def local_sources(pool: Any) -> dict[int, KvSource]:
    """The KvSource of each local vLLM engine of `pool` started with KV
    events (VllmConfig.kv_events_dir), by worker index. The description is
    read from the worker's current engine (a restart replaces it)."""
    out: dict[int, KvSource] = {}
    workers = getattr(pool, "workers", [])
    for w in workers:
        folder = getattr(getattr(w.engine, "config", None), "kv_events_dir", None)
        if folder is None:
            continue
        pub, replay = kv_event_endpoints(folder, w.index)

        def describe(i: int = w.index) -> tuple[int, str] | None:
            return engine_description(workers[i].engine)

        out[w.index] = KvSource(name=str(w.index), endpoint=pub, replay=replay, describe=describe)
    return out


def remote_sources(kv_events: str, urls: Sequence[str]) -> dict[int, KvSource]:
    """`;kv-events=PUB[|REPLAY],...`: one publisher per URL, in URL order
    (the node's `--kv-events-config` endpoint, e.g. tcp://node:5557, and
    its replay_endpoint). Block size from the events; sha256."""
    out: dict[int, KvSource] = {}
    for i, (spec, url) in enumerate(zip(kv_events.split(","), urls, strict=True)):
        pub, _, replay = spec.strip().partition("|")
        if not pub.startswith(("tcp://", "ipc://")) or (replay and not replay.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"kv-events {spec!r}: expected tcp://HOST:PORT or ipc://PATH[|REPLAY]")
        out[i] = KvSource(name=url, endpoint=pub, replay=replay or None)
    return out


def body_tokenizer(folder: str) -> Callable[[Mapping[str, Any]], list[int] | None]:
    """A request body -> the token ids a vLLM node makes of it: the chat
    template (generation prompt added) of `messages`, or a completions
    `prompt` string; None for anything else (tools, multimodal parts)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)

    def tokenize(body: Mapping[str, Any]) -> list[int] | None:
        msgs = body.get("messages")
        if isinstance(msgs, list) and not body.get("tools"):
            if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
                return None
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False).input_ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return list(tok(prompt).input_ids)
        return None

    return tokenize


def remote_kv_policy(cfg: Any, opts: Any) -> KvEventsPolicy:
    """kv-events over an upstream's URLs (an UpstreamConfig): their
    publishers (`;kv-events=`) and tokenizer (`;kv-tokenizer=`); without
    either, the `prefix` guess on the request's text."""
    sources = remote_sources(cfg.kv_events, cfg.urls) if cfg.kv_events else None
    p = make_policy("kv-events", opts, unit="tokens" if cfg.kv_tokenizer else "bytes", sources=sources)
    assert isinstance(p, KvEventsPolicy)
    if cfg.kv_tokenizer:
        p.tokenize = body_tokenizer(cfg.kv_tokenizer)
    elif sources:
        logger.warning("upstream %s: kv-events without ;kv-tokenizer=FOLDER: the gateway cannot hash its prompts "
                       "and routes on the prefix guess (the index is kept and exported)", cfg.name)
    return p
