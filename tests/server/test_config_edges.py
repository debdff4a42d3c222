"""Typed configuration edges: the keys file, the `NAME=VALUE[;k=v]` flags
(one parser), and `serve --help` with defaults."""

from __future__ import annotations

import ipaddress
import pickle
from pathlib import Path
from typing import Any

import pytest

from engine_adapter.entry import parse_entry
from engine_adapter.routing import policy, spec, upstream
from server.auth import KeysFileError, load_keys_file
from server.cli import main
from server.models_setup import build_remote_pools, set_routing_policies
from server.settings import Settings
from server.settings_parse import ExtraModel

DIGEST = "a" * 64


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "keys.yaml"
    p.write_text(text)
    return p


def test_a_good_keys_file_loads(tmp_path: Path) -> None:
    p = write(tmp_path, f"keys:\n- name: team-a\n  sha256: {DIGEST}\n  models: [sim]\n  requests_per_minute: 60\n")
    (e,) = load_keys_file(p)
    assert e.name == "team-a" and e.models == frozenset({"sim"}) and e.requests_per_minute == 60


@pytest.mark.parametrize(
    ("entry", "field"),
    [
        ('  requests_per_minute: "60"', "requests_per_minute"),  # a string is not a number
        ("  models: sim", "models"),  # not a list (was a set of letters)
        ("  max_concurrent: 0", "max_concurrent"),
        ("  request_per_minute: 5", "request_per_minute"),  # a typo is not ignored
        ("  admin: yes-please", "admin"),
    ],
)
def test_a_bad_keys_file_names_file_entry_and_field(tmp_path: Path, entry: str, field: str) -> None:
    p = write(tmp_path, f"keys:\n- name: ok\n  sha256: {DIGEST}\n- name: team-b\n  sha256: {DIGEST}\n{entry}\n")
    with pytest.raises(KeysFileError) as e:
        load_keys_file(p)
    msg = str(e.value)
    assert str(p) in msg and "key #2 ('team-b')" in msg and f"`{field}`" in msg


def test_serve_stops_at_start_on_a_bad_keys_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = write(tmp_path, f"keys:\n- name: x\n  sha256: {DIGEST}\n  tokens_per_minute: lots\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--backend", "simulated", "--api-keys-file", str(p)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid keys file" in err and "tokens_per_minute" in err and "Traceback" not in err


def test_one_entry_parser() -> None:
    e = parse_entry("up=http://a:1, http://b:2 ;model=m;read-timeout=3", "upstream", "S",
                    options=("model", "read_timeout"))
    assert e.name == "up" and e.items == ("http://a:1", "http://b:2")
    assert e.options == {"model": "m", "read_timeout": "3"}
    raw = parse_entry('k={"a": 1, "b": "x=y;z"}', "--engine-arg", "KEY=VALUE", many=False)
    assert raw.items == ('{"a": 1, "b": "x=y;z"}',)  # one value: commas, = and ; untouched
    with pytest.raises(ValueError, match=r"upstream 'up': unknown option 'colour=red' \(options: model"):
        parse_entry("up=http://a;colour=red", "upstream", "S", options=("model",))
    for bad in ("noequals", "=x", "name="):
        with pytest.raises(ValueError, match="expected S"):
            parse_entry(bad, "--alias", "S")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"alias": ["chat"]}, "alias 'chat': expected NAME=ITEM"),
        ({"fallback": ["a="]}, "fallback 'a=': expected NAME=ITEM"),
        ({"upstream": ["u=http://x;bogus=1"]}, "upstream 'u': unknown option 'bogus=1'"),
        ({"upstream": ["u=http://x;read_timeout=soon"]}, "is not a number"),
        ({"extra_model": ["=/m"]}, "--extra-model '=/m': expected NAME[,ALIAS...]=PATH"),
        ({"engine_args": ["=3"]}, "--engine-arg '=3': expected KEY=VALUE"),
    ],
)
def test_every_entry_flag_reports_through_the_one_parser(kw: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        Settings(**kw)  # type: ignore[arg-type]


def test_entry_flags_parse() -> None:
    s = Settings(extra_model=["a,b=/m"], engine_args=["kv_cache_dtype=fp8", "max-logprobs=40"],
                 upstream=["u=http://x:1"])
    assert s.extra_models() == [(("a", "b"), "/m")]
    assert s.engine_args == {"kv_cache_dtype": "fp8", "max_logprobs": 40}


def test_serve_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--max-queue-size MAX_QUEUE_SIZE in-process queue bound per model (default: 1024)" in out
    assert "(default: 8000)" in out and "(default: 127.0.0.1)" in out


def test_the_settings_parse_once_and_the_pools_read_the_parsed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Settings(model="none", upstream=["u=http://x:1;api=messages", "http://y:2"], alias=["c=u:1"],
                 fallback=["d=u"], routing_policy=["prefix", "u=session"], trusted_proxies=["10.0.0.0/8"],
                 extra_model=["a,b=/m;devices=4,5"], upstream_read_timeout=7)
    p = s.parsed
    assert [u.name for u in p.upstreams] == ["u", "y:2"]
    assert p.upstreams[0].read_timeout == 7 and p.upstreams[0].apis == {"messages"} and p.upstreams[1].apis is None
    assert p.policies == ("prefix", {"u": "session"}) and set(p.routes) == {"c", "d"}
    assert p.proxies == (ipaddress.ip_network("10.0.0.0/8"),)
    assert p.extra_models == (ExtraModel(("a", "b"), "/m", ("4", "5")),) and p.lora_modules == ()
    assert pickle.loads(pickle.dumps(s)).parsed == p  # --workers: the spawned processes get them too
    s.alias = ["e=u:1"]  # a value set later is parsed as one given at start
    assert set(s.parsed.routes) == {"d", "e"} and s.parsed.upstreams == p.upstreams

    def again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a setting parsed again")

    for module, name in ((upstream, "parse_upstream"), (policy, "parse_policies"), (spec, "route_specs")):
        monkeypatch.setattr(module, name, again)
    served = build_remote_pools(s)
    set_routing_policies(s, served)
    assert [names for _, names, _ in served] == [("u",), ()]
    assert [up.policy.name for pool, _, _ in served for up in upstream.upstreams_of([pool])] == ["session", "prefix"]
