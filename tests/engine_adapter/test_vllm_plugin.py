"""The vLLM general plugin: registered for vLLM to find, and what it does to
the shared-memory queue readers vLLM then creates."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from engine_adapter.backends import vllm_plugin


@pytest.fixture
def vllm_spin_default() -> Iterator[None]:
    """Undo what the plugin sets on vLLM's class."""
    saved = shm_broadcast.SpinCondition.__init__.__defaults__
    yield
    shm_broadcast.SpinCondition.__init__.__defaults__ = saved


def reader_busy_loop() -> float:
    """The spin of a queue reader created now, as vLLM's MessageQueue creates
    it (no busy_loop_s argument)."""
    ctx = zmq.Context()
    try:
        cond = shm_broadcast.SpinCondition(is_reader=True, context=ctx, notify_address=f"ipc://{uuid.uuid4().hex}")
        return float(cond.busy_loop_s)
    finally:
        ctx.destroy(linger=0)


def test_vllm_finds_the_plugin() -> None:
    found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert found.get("npu_gateway") == "engine_adapter.backends.vllm_plugin:register"


def test_the_gateways_variable_sets_the_readers_spin(monkeypatch: pytest.MonkeyPatch, vllm_spin_default: None) -> None:
    assert reader_busy_loop() == 1.0  # vLLM's own default
    monkeypatch.setenv(vllm_plugin.BUSY_LOOP_ENV, "0")
    vllm_plugin.register()
    assert reader_busy_loop() == 0.0


def test_without_the_variable_vllm_keeps_its_default(monkeypatch: pytest.MonkeyPatch, vllm_spin_default: None) -> None:
    monkeypatch.delenv(vllm_plugin.BUSY_LOOP_ENV, raising=False)
    vllm_plugin.register()
    assert reader_busy_loop() == 1.0


def test_a_bad_value_is_ignored(monkeypatch: pytest.MonkeyPatch, vllm_spin_default: None) -> None:
    monkeypatch.setenv(vllm_plugin.BUSY_LOOP_ENV, "soon")
    vllm_plugin.register()
    assert reader_busy_loop() == 1.0
