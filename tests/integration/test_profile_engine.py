"""/start_profile and /stop_profile wrap vLLM's torch profiler (admin key)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from support import EMBEDDED, GatewayProcess, wait_until_sync

pytestmark = pytest.mark.engine
ADMIN = {"Authorization": "Bearer sk-admin"}


def test_profile_needs_admin_key_and_writes_traces(real_gateway: GatewayProcess) -> None:
    url = real_gateway.url
    profile_dir: Path = real_gateway.profile_dir  # type: ignore[attr-defined]
    r = httpx.post(url + "/start_profile")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(url + "/start_profile", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(url + "/start_profile", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    gen = httpx.post(url + "/v1/completions", json={"model": EMBEDDED, "prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert gen.status_code == 200  # the API itself needs no key on this server
    assert httpx.post(url + "/stop_profile", headers=ADMIN, timeout=120).status_code == 200
    # the engine worker's traces (on CPU the front end is left out)
    wait_until_sync(lambda: any(profile_dir.glob("*.pt.trace.json.gz")), timeout=30,
                    what=f"a trace in {profile_dir}", interval=0.5)
    traces = sorted(profile_dir.glob("*.pt.trace.json.gz"))
    assert all(t.stat().st_size > 0 for t in traces)
