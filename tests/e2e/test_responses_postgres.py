"""Stored /v1/responses across replicas: two gateway processes (simulated
engine) with one `--responses-db postgresql://...` on a real PostgreSQL
(tests/pg_server.py). A response stored through one replica is read by id
and continued with `previous_response_id` through the other; another key
sees neither."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import yaml
from pg_server import PostgresServer
from support import GatewayProcess, wait_until_sync

from server.auth import sha256_hex

pytestmark = pytest.mark.e2e

ALICE = {"Authorization": "Bearer sk-alice"}
BOB = {"Authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def replicas(postgres: PostgresServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GatewayProcess]]:
    tmp = tmp_path_factory.mktemp("responses-pg")
    started: list[GatewayProcess] = []
    try:
        url = postgres.new_database("responses_" + os.urandom(3).hex())
        keys = tmp / "keys.yaml"
        keys.write_text(yaml.safe_dump({"keys": [
            {"name": "alice", "sha256": sha256_hex("sk-alice")}, {"name": "bob", "sha256": sha256_hex("sk-bob")},
        ]}))
        for name in ("one", "two"):
            started.append(GatewayProcess(
                ["--backend", "simulated", "--embedding-model", "none", "--served-model-name", "sim",
                 "--api-keys-file", str(keys), "--responses-db", url, "--usage-db", "none",
                 "--data-dir", str(tmp / name), "--access-log-format", "off"],
                tmp / f"{name}.log",
            ))
        for gw in started:
            gw.wait_ready(timeout=90)
        yield started
    finally:
        for gw in started:
            gw.stop()


def test_each_replica_reads_and_continues_the_others_responses(replicas: list[GatewayProcess]) -> None:
    one, two = replicas
    r1 = httpx.post(one.url + "/v1/responses", json={"model": "sim", "input": "first question", "max_output_tokens": 4},
                    headers=ALICE, timeout=30)
    assert r1.status_code == 200, r1.text
    rid = r1.json()["id"]

    def readable() -> bool:  # the write leaves the request path: visible once committed
        return httpx.get(f"{two.url}/v1/responses/{rid}", headers=ALICE, timeout=10).status_code == 200

    wait_until_sync(readable, timeout=10, what="replica two to read replica one's response")
    got = httpx.get(f"{two.url}/v1/responses/{rid}", headers=ALICE, timeout=10).json()
    assert got["id"] == rid and got["output"] == r1.json()["output"]
    assert httpx.get(f"{two.url}/v1/responses/{rid}", headers=BOB, timeout=10).status_code == 404

    r2 = httpx.post(two.url + "/v1/responses", json={"model": "sim", "input": "second question",
                                                     "previous_response_id": rid, "max_output_tokens": 4},
                    headers=ALICE, timeout=30)
    assert r2.status_code == 200, r2.text
    assert r2.json()["previous_response_id"] == rid
    rid2 = r2.json()["id"]
    wait_until_sync(lambda: httpx.get(f"{one.url}/v1/responses/{rid2}/input_items", headers=ALICE,
                                      timeout=10).status_code == 200, timeout=10, what="replica one to read it back")
    items = httpx.get(f"{one.url}/v1/responses/{rid2}/input_items", headers=ALICE, timeout=10).json()["data"]
    texts = str(items)
    assert "second question" in texts
    # and the chain continues on replica one
    r3 = httpx.post(one.url + "/v1/responses", json={"model": "sim", "input": "third", "previous_response_id": rid2,
                                                     "max_output_tokens": 4}, headers=ALICE, timeout=30)
    assert r3.status_code == 200, r3.text
    # an unknown id on either replica: 404 (not 500)
    r = httpx.post(two.url + "/v1/responses", json={"model": "sim", "input": "x", "previous_response_id": "resp_nope"},
                   headers=ALICE, timeout=30)
    assert r.status_code in (400, 404), r.text
