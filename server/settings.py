"""One settings object from CLI flags, `NPUGW_*` environment variables and an
optional YAML file (`--config`), validated at start-up. Precedence: flags,
then environment, then the file, then defaults. Flag names follow
`vllm serve` where the meaning is the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from server.settings_parse import Parsed, collect, keep, parse_engine_args, parse_extra_model, parse_proxies
from server.state_url import check_state_url

# `NAME=...` lists: repeatable flags, a YAML list or mapping, or one
# whitespace-separated environment variable (NPUGW_UPSTREAM="a=http://x b=http://y").
Entries = Annotated[list[str], NoDecode]
# vLLM engine arguments: repeatable KEY=VALUE flags, a YAML mapping, or a JSON
# object in the environment (NPUGW_ENGINE_ARGS='{"kv_cache_dtype": "fp8"}').
EngineArgs = Annotated[dict[str, Any], NoDecode]


class Settings(BaseSettings):
    # validate_assignment: a value set later is validated and parsed as one given at start.
    model_config = SettingsConfigDict(
        env_prefix="NPUGW_", extra="forbid", validate_default=True, validate_assignment=True
    )
    _parsed: Parsed | None = PrivateAttr(None)  # server/settings_parse.py: `parsed`

    config: Path | None = Field(None, description="YAML settings file")
    # --- HTTP ---
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    workers: int = Field(
        1, ge=1,
        description="gateway processes sharing the port (SO_REUSEPORT); more than 1 only with --model none "
        "(gateway-only); metrics cover all of them, limits are per process",
    )
    log_level: str = Field("info", description="log level")
    # --- models ---
    model: str | None = Field(
        None, description="local Hugging Face folder; default: the embedded SmolLM2; 'none': no local engine "
        "(a gateway tier in front of --upstream nodes)",
    )
    served_model_name: Entries = Field(default_factory=list, description="names (aliases) the model is served under")
    embedding_model: str | None = Field(
        "embedded", description="embedding model folder, 'embedded' (all-MiniLM-L6-v2) or 'none'"
    )
    embedding_served_model_name: Entries = Field(default_factory=list, description="names of the embedding model")
    embedding_cpu_bind: str = Field(
        "auto",
        description="(CPU) cores of the embedding engine's OpenMP threads: 'auto' (one thread on the last "
        "core; with 16 or more cores that core is left out of the generators' set), 'shared' (the "
        "generators' cores and thread count), or a list such as '7' or '6-7'",
    )
    worker_cpu_bind: Literal["auto", "shared"] = Field(
        "auto",
        description="(CPU, --num-workers N) cores of each generation engine's OpenMP threads: 'auto' (each "
        "worker its own share of the generators' cores, when there are at least N and "
        "VLLM_CPU_OMP_THREADS_BIND is not set), 'shared' (every worker on all of them)",
    )
    embedding_busy_loop: float | None = Field(
        None, ge=0.0,
        description="seconds the embedding engine's worker spins for its next step after its last one (vLLM's "
        "shared-memory queue reader). Unset: 0.05 on CPU, where the spin takes a core the generator "
        "computes on; vLLM's 1 s on NPU/GPU",
    )
    embedding_start: Literal["auto", "eager", "lazy"] = Field(
        "auto",
        description="when the embedding engine starts: 'lazy' on the first embeddings (or tokenize) request, "
        "which waits for it (~20 s on CPU); 'eager' with the gateway; 'auto': lazy on CPU, where an idle "
        "engine still costs the generator's token latency, eager on NPU/GPU (its device memory is taken "
        "at start-up)",
    )
    embedding_gpu_memory_utilization: float = Field(
        0.05, gt=0.0, le=1.0,
        description="(NPU/GPU) device memory fraction of the embedding engine, on top of "
        "--gpu-memory-utilization of the generator on the same device",
    )
    extra_model: Entries = Field(
        default_factory=list,
        description="more generator models, each with its own pool: NAME[,ALIAS...]=PATH[;devices=4,5] "
        "(repeatable; devices: its engines' own devices, NPU/GPU)",
    )
    backend: Literal["vllm", "simulated"] = Field("vllm", description="engine backend (simulated: benchmarks/tests)")
    device: Literal["auto", "npu", "cuda", "cpu"] = Field("auto", description="device; auto detects")
    devices: Entries = Field(
        default_factory=list,
        description="(NPU/GPU) the devices the engines may use, as npu-smi / nvidia-smi number them (0,1,...); "
        "default: all listed. Each engine gets its own group of --tensor-parallel-size x "
        "--pipeline-parallel-size of them (ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES); "
        "`npu-gateway plan` shows where each engine goes",
    )
    # --- vLLM engine args ---
    max_model_len: int | None = Field(None, ge=16, description="context length")
    dtype: str = Field("auto", description="weights dtype")
    enforce_eager: bool | None = Field(None, description="disable graph capture / compilation")
    max_num_seqs: int = Field(256, ge=1, description="max concurrent sequences per engine")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="max tokens per engine step")
    block_size: int | None = Field(None, ge=1, description="KV cache block size")
    enable_prefix_caching: bool | None = Field(None, description="automatic prefix caching")
    tensor_parallel_size: int = Field(1, ge=1, description="tensor parallel size")
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline parallel size")
    distributed_executor_backend: Literal["ray", "mp", "uni"] | None = Field(None, description="executor")
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0, description="device memory fraction")
    quantization: str | None = Field(None, description="quantization method")
    scheduling_policy: Literal["fcfs", "priority"] = Field("fcfs", description="vLLM scheduling policy")
    seed: int | None = Field(None, description="engine seed")
    load_format: str | None = Field(
        None,
        description="weights format, as vllm serve's: auto, safetensors, dummy (random weights, for benchmarks), "
        "...; the generation models (--model, --extra-model), not the embedding model",
    )
    engine_args: EngineArgs = Field(
        default_factory=dict,
        description="any other vLLM engine argument, as vllm serve --KEY VALUE (repeatable; '-' in KEY "
        "reads as '_'); VALUE is JSON when it parses (40, true, [1,2], {...}), else a string; env: a JSON "
        "object, YAML: a mapping. The generation models get them, not the embedding model. Keys a gateway "
        "flag sets (model, max_model_len, dtype, ...) are refused: use that flag",
    )
    # --- LoRA adapters (engine_adapter/lora.py, lora_manager.py) ---
    enable_lora: bool = Field(False, description="serve LoRA adapters on the generation models' engines")
    max_loras: int = Field(1, ge=1, description="LoRA adapters in one engine batch (vLLM's --max-loras)")
    max_lora_rank: int = Field(
        16, description="largest LoRA rank an adapter may have: 1, 8, 16, 32, 64, 128, 256, 320 or 512"
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, description="LoRA adapters kept in host memory per engine (vLLM's; default: --max-loras)"
    )
    lora_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="adapters to serve from the start: NAME=PATH or vLLM's JSON form "
        '{"name": ..., "path": ..., "base_model_name": ...} (repeatable; needs --enable-lora). Adapters '
        "loaded at run time (POST /v1/load_lora_adapter) are kept in DATA_DIR/lora_adapters.json",
    )
    # --- pool / admission ---
    num_workers: int = Field(1, ge=1, description="engine instances per model")
    max_queue_size: int = Field(1024, ge=0, description="in-process queue bound per model")
    max_queue_wait: float = Field(60.0, gt=0, description="seconds a request may wait for an engine slot")
    queue_policy: Literal["fair", "fifo"] = Field(
        "fair",
        description="order inside one priority: `fair` shares slots between API keys by weighted deficit round "
        "robin on estimated cost (each key's `weight` in the keys file), `fifo` serves in arrival order. "
        "A SIGHUP reload of --config may switch it; queued requests stay queued",
    )
    fair_reserve_slots: int = Field(
        0,
        ge=0,
        description="extra engine slots per worker (each local engine runs --max-num-seqs + N sequences) that "
        "admission gives only to a request that would otherwise wait and whose API key has nothing running nor "
        "queued in that model (a new flow), or whose priority value is below every running request's; with "
        "--queue-policy fair. A key sending one request at a time behind a flood then starts at once instead of "
        "after a slot frees. Cost: up to N more sequences per engine (KV memory for them; slightly slower "
        "tokens for the others). 0: off",
    )
    request_timeout: float = Field(600.0, gt=0, description="seconds a whole request may take")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds to drain in-flight requests on SIGTERM")
    readiness_interval: float = Field(5.0, gt=0, description="seconds between readiness probes")
    readiness_probe: Literal["passive", "active"] = Field(
        "passive",
        description="passive: an engine that produced output within the interval counts as ready and gets "
        "no probe request; active: only probes and finished requests count",
    )
    # --- routing between the engines of one model (engine_adapter/routing/policy.py) ---
    routing_policy: Entries = Field(
        default_factory=lambda: ["least-outstanding"],
        description="which engine of a model (--num-workers, or the URLs of an --upstream) serves a request: "
        "least-outstanding, session (hash of X-Session-ID or user), or prefix (the engine that saw the longest "
        "prefix of the prompt; a session key takes precedence), or kv-events (as prefix, on the engines' own KV "
        "cache events: docs/kv-events.md); POLICY for every model or NAME=POLICY "
        "(repeatable)",
    )
    routing_prefix_max_blocks: int = Field(
        131072, ge=1, description="prefix policy: prompt blocks remembered per model (least recently used out)"
    )
    routing_prefix_block_bytes: int = Field(
        256, ge=1, description="prefix policy, upstream nodes: bytes of the request's JSON per block"
    )
    routing_balance_abs_threshold: int = Field(
        16, ge=0, description="prefix policy: least outstanding instead when the matched engine has more than "
        "this many requests in flight above the least-loaded one ..."
    )
    routing_balance_rel_threshold: float = Field(
        1.5, ge=1.0, description="... and more than this many times its requests in flight"
    )
    max_n: int = Field(8, ge=1, description="largest n accepted")
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="request body limit")
    sse_keep_alive_interval: float = Field(15.0, gt=0, description="seconds between SSE keep-alive comments")
    # --- auth ---
    api_key: Entries = Field(default_factory=list, description="accepted API keys (repeatable)")
    api_keys_file: Path | None = Field(None, description="YAML keys file (sha256 of keys, limits)")
    metrics_api_key: str | None = Field(None, description="key required for /metrics")
    admin_api_key: str | None = Field(None, description="key for admin routes (default: any --api-key)")
    # --- stored state ---
    data_dir: Path = Field(
        Path("~/.cache/npu-gateway/data"),
        description="folder of the gateway's embedded databases (created on first use)",
    )
    responses_db: str | None = Field(
        None,
        description="stored /v1/responses: a SQLite file, postgresql://USER:PASSWORD@HOST:PORT/DB (shared by "
        "replicas: each sees the others' responses) or an SQLAlchemy async URL; default DATA_DIR/responses.db; "
        "'none' stores nothing",
    )
    # --- limits shared by replicas (server/state_store.py) ---
    state_url: str | None = Field(
        None,
        description="Valkey/Redis that holds the keys' per-minute limits and concurrency leases for every "
        "process and replica: redis://[:PASSWORD@]HOST:PORT/DB, rediss://... (TLS) or unix:///PATH.sock; "
        "unset: limits count in each process",
    )
    state_fail: Literal["open", "closed"] = Field(
        "open",
        description="while the --state-url store does not answer: open (count in this process, warn once a "
        "minute) or closed (503 + Retry-After for keys with limits)",
    )
    state_timeout: float = Field(0.25, gt=0, le=10, description="seconds a call to the --state-url store may take")
    state_lease_ttl: float = Field(
        10.0, gt=0, le=60,
        description="seconds a concurrency lease outlives its last renewal (a killed replica's leases lapse "
        "within it)",
    )
    # --- the usage ledger and budgets (server/usage) ---
    usage_db: str | None = Field(
        None,
        description="usage ledger: a SQLite file, sqlite:///PATH, postgresql://USER:PASSWORD@HOST:PORT/DB (shared "
        "by replicas: one ledger, one set of budgets) or an SQLAlchemy async URL; default DATA_DIR/usage.db; "
        "'none': no ledger (budgets then count in this process's memory only)",
    )
    usage_flush_interval: float = Field(
        0.5, gt=0, description="seconds between the ledger's batch writes (and budget refreshes from the database)"
    )
    usage_batch_size: int = Field(500, ge=1, description="records per ledger write (a full batch is written at once)")
    usage_buffer_size: int = Field(
        20000, ge=1, description="records the ledger holds in memory; past that they go straight to the spool"
    )
    usage_write_timeout: float = Field(
        5.0, gt=0, description="seconds a ledger write may take before its records go to the spool"
    )
    usage_spool_dir: Path | None = Field(
        None, description="where records wait while the ledger's database is down (default DATA_DIR/usage-spool)"
    )
    # --- observability ---
    device_probe_interval: float = Field(5.0, gt=0, description="seconds between device memory probes")
    profile_dir: Path | None = Field(None, description="where /start_profile writes traces")
    # --- simulated backend ---
    simulated_ttft: float = Field(0.0, ge=0, description="simulated time to first token")
    simulated_itl: float = Field(0.0, ge=0, description="simulated inter-token delay")
    # --- remote upstreams (the remote backend) ---
    upstream: Entries = Field(
        default_factory=list,
        description="remote model NAME=URL[,URL...][;option=value...] (repeatable), passed through to its "
        "nodes; without NAME= (or with ;model=*): every model the nodes list, under its own id "
        "(docs/upstream-discovery.md); options: model (the node's model id when it serves several; * for "
        "every one), connect_timeout, read_timeout, "
        "health_interval, eject_after, cooldown, max_model_len, api_key_env, plain (direct: a non-streaming "
        "client's call goes as it came; stream: it is served from a streamed call joined back)",
    )
    upstream_connect_timeout: float = Field(2.0, gt=0, description="seconds to connect to an upstream")
    upstream_read_timeout: float = Field(
        30.0, gt=0, description="seconds an upstream may stay silent (before its headers, between chunks)"
    )
    upstream_health_interval: float = Field(5.0, gt=0, description="seconds between upstream health checks")
    upstream_eject_after: int = Field(3, ge=1, description="failures in a row that eject an upstream URL")
    upstream_cooldown: float = Field(10.0, gt=0, description="seconds an ejected upstream URL waits for a trial")
    # --- routing: aliases, canaries, fallbacks ---
    alias: Entries = Field(
        default_factory=list, description="ALIAS=TARGET:WEIGHT[,TARGET:WEIGHT...] weighted alias (repeatable)"
    )
    fallback: Entries = Field(
        default_factory=list, description="NAME=FIRST[,SECOND...] ordered fallback targets (repeatable)"
    )
    canary_window: float = Field(60.0, gt=0, description="seconds of the canary rollback window")
    canary_min_requests: int = Field(20, ge=1, description="requests in the window before a canary is judged")
    canary_max_error_rate: float | None = Field(0.5, ge=0, le=1, description="roll a canary back above this")
    canary_max_ttft_p95: float | None = Field(None, gt=0, description="roll a canary back above this TTFT p95 (s)")

    access_log_format: Literal["json", "text", "off"] = Field(
        "text", description="one line per request (json or text; off: none)"
    )
    access_log_file: Path | None = Field(None, description="access log file (default: stderr)")
    trusted_proxies: Entries = Field(
        default_factory=list, description="proxy addresses/CIDRs whose X-Forwarded-For is believed (repeatable)"
    )
    otlp_traces_endpoint: str | None = Field(
        None, description="OTLP collector for traces (protocol: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); off when unset"
    )

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        """`--devices 0,1 2` / NPUGW_DEVICES="0,1,2" / a YAML list -> ["0", "1", "2"]."""
        items = [v] if isinstance(v, str | int) else v
        if isinstance(items, list | tuple):
            return [p for item in items for p in str(item).replace(",", " ").split()]
        return v

    @field_validator("served_model_name", "embedding_served_model_name", "api_key", "trusted_proxies",
                     mode="before")
    @classmethod
    def _split(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [s for s in (p.strip() for p in v.split(",")) if s]
        return v

    @field_validator("state_url")
    @classmethod
    def _state_url(cls, v: str | None) -> str | None:
        if v is None or not v.strip() or v.strip().lower() == "none":
            return None
        return check_state_url(v.strip())

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, v: list[str]) -> list[str]:
        keep("proxies", parse_proxies(v))  # a bad address or network fails at start-up
        return v

    @field_validator("routing_policy", mode="before")
    @classmethod
    def _routing_policy(cls, v: Any) -> Any:
        from engine_adapter.routing.policy import parse_policies

        if isinstance(v, str):  # NPUGW_ROUTING_POLICY="prefix chat=session"
            v = v.replace(",", " ").split()
        if isinstance(v, list | tuple):
            keep("policies", parse_policies(str(item) for item in v))
        return v

    @field_validator("max_lora_rank")
    @classmethod
    def _lora_rank(cls, v: int) -> int:
        from engine_adapter.lora import MAX_LORA_RANKS

        if v not in MAX_LORA_RANKS:
            raise ValueError(f"--max-lora-rank {v}: expected one of {', '.join(map(str, MAX_LORA_RANKS))}")
        return v

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _lora_modules(cls, v: Any) -> Any:
        from engine_adapter.lora import parse_lora_module

        if isinstance(v, str):  # env: a JSON list, or NAME=PATH items separated by whitespace
            text = v.strip()
            v = json.loads(text) if text.startswith("[") else text.split()
        if isinstance(v, list | tuple):
            v = [json.dumps(x) if isinstance(x, dict) else str(x) for x in v]
            keep("lora_modules", tuple(parse_lora_module(item) for item in v))
        return v

    @field_validator("extra_model")
    @classmethod
    def _extra_models(cls, v: list[str]) -> list[str]:
        keep("extra_models", tuple(parse_extra_model(item) for item in v))
        return v

    def extra_models(self) -> list[tuple[tuple[str, ...], str]]:
        return [(m.names, m.path) for m in self.parsed.extra_models]

    def extra_model_devices(self) -> list[tuple[str, ...] | None]:
        """Each --extra-model's own devices (`;devices=4,5`), or None."""
        return [m.devices for m in self.parsed.extra_models]

    @field_validator("engine_args", mode="before")
    @classmethod
    def _engine_args(cls, v: Any) -> dict[str, Any]:
        return parse_engine_args(v)

    @field_validator("upstream", "alias", "fallback", mode="before")
    @classmethod
    def _entries(cls, v: Any) -> Any:
        from engine_adapter.routing.spec import entries

        return entries(v)

    @model_validator(mode="after")
    def _routes(self) -> Settings:
        from engine_adapter.routing.spec import route_specs
        from engine_adapter.routing.upstream import parse_upstream

        upstreams = tuple(
            parse_upstream(
                spec, connect_timeout=self.upstream_connect_timeout, read_timeout=self.upstream_read_timeout,
                health_interval=self.upstream_health_interval, eject_after=self.upstream_eject_after,
                cooldown=self.upstream_cooldown,
            )
            for spec in self.upstream
        )
        names = [u.name for u in upstreams]
        if len(set(names)) != len(names):
            raise ValueError("an upstream name is given twice")
        keep("upstreams", upstreams)
        keep("routes", route_specs(self.alias, self.fallback))
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} must be >= --max-loras {self.max_loras}")
        return self

    # Last, so that it wraps the validators above: what they `keep` becomes `parsed`.
    @model_validator(mode="wrap")
    @classmethod
    def _parse_once(cls, data: Any, handler: ModelWrapValidatorHandler[Settings]) -> Settings:
        return collect(data, handler)

    @property
    def parsed(self) -> Parsed:
        """The parsed values (server/settings_parse.py), computed once at validation."""
        if self._parsed is None:
            raise RuntimeError("Settings built without validation (model_construct) have no parsed values")
        return self._parsed

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        cfg = _config_path(init_settings)
        if cfg is not None:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=cfg))
        return tuple(sources)

    @property
    def gateway_only(self) -> bool:
        """`--model none`: no local engine, only upstream nodes."""
        return self.model == "none"

    @property
    def embedding_enabled(self) -> bool:
        return self.embedding_model not in (None, "", "none") and not self.gateway_only


def _config_path(init: PydanticBaseSettingsSource) -> Path | None:
    import os

    data = init()
    value = data.get("config") or os.environ.get("NPUGW_CONFIG")
    return Path(value) if value else None
