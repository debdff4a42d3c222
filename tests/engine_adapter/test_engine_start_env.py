"""vllm_env.start_with_env: each engine start's processes get its own
environment, and a second start begins as soon as the first one's process is
spawned (not when it is ready), with real multiprocessing spawn children."""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from engine_adapter.backends.vllm_env import start_with_env

VAR = "NPUGW_TEST_START_ENV"


def spawned_child_writes_its_env(out: Path) -> BaseProcess:
    """A spawn child (as AsyncLLM starts its EngineCore, which lives on)
    that writes the value of VAR it started with; os.system runs in the
    child."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=os.system, args=(f'printf %s "${VAR}" > {out}; sleep 2',))
    proc.start()
    return proc


def test_two_starts_overlap_and_each_child_sees_its_own_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(VAR, "gateway")
    first_spawned = threading.Event()
    second_began = threading.Event()
    results: dict[str, object] = {}

    def first() -> str:
        proc = spawned_child_writes_its_env(tmp_path / "a")
        first_spawned.set()
        # the first engine is still loading: the second start must not wait for it
        results["overlap"] = second_began.wait(30)
        proc.join(60)
        return "a"

    def second() -> str:
        second_began.set()
        spawned_child_writes_its_env(tmp_path / "b").join(60)
        return "b"

    def run(name: str, value: str, start: Callable[[], str]) -> None:
        results[name] = start_with_env([(VAR, value)], start)

    a = threading.Thread(target=run, args=("a", "one", first))
    a.start()
    assert first_spawned.wait(60)
    b = threading.Thread(target=run, args=("b", "two", second))
    b.start()
    a.join(90)
    b.join(90)
    assert results["overlap"] is True
    assert (results["a"], results["b"]) == ("a", "b")
    assert (tmp_path / "a").read_text() == "one"
    assert (tmp_path / "b").read_text() == "two"
    assert os.environ[VAR] == "gateway"  # the gateway's own value is back


def test_a_start_that_spawns_nothing_holds_the_env_to_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """No spawned child to wait for (another start method, or a failure
    before the spawn): the environment stays set and other starts wait until
    this one ends."""
    monkeypatch.delenv(VAR, raising=False)
    second_began = threading.Event()
    seen: list[str | None] = []

    def first() -> None:
        seen.append(os.environ.get(VAR))
        seen.append("second began early" if second_began.wait(0.5) else None)
        seen.append(os.environ.get(VAR))

    def second() -> None:
        second_began.set()

    a = threading.Thread(target=start_with_env, args=([(VAR, "one")], first))
    a.start()
    b = threading.Thread(target=start_with_env, args=([(VAR, "two")], second))
    b.start()
    a.join(30)
    b.join(30)
    assert seen == ["one", None, "one"]
    assert second_began.is_set() and VAR not in os.environ


def test_a_failed_start_releases_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VAR, raising=False)

    def fails() -> None:
        raise RuntimeError("engine died at start")

    with pytest.raises(RuntimeError):
        start_with_env([(VAR, "one")], fails)
    assert VAR not in os.environ
    assert start_with_env([(VAR, "two")], lambda: os.environ[VAR]) == "two"  # the lock is free again
