"""The ledger's HTTP API.

- `GET /admin/usage` (admin key): usage by hour, day, month, key or model,
  filtered by key, model and time (server/usage/query.py), as JSON or CSV
  (`format=csv`). An unknown key is 404.
- `GET /v1/usage` (any key): the same, for the caller's own key only.
- `GET /admin/budgets` (admin key): every key with budgets or an expiry:
  its limits, what it used and when each resets.
- `PUT /admin/budgets/{key}` (admin key): set budgets at run time, with no
  restart; every replica sharing the database applies them at its next
  refresh. The body names the budgets it changes, each a positive integer
  or null (no limit), and `expires_at` (ISO 8601, or null: never):
  `{"tokens_per_day": 200000, "expires_at": "2027-01-01"}`.

With the ledger off (`--usage-db none`), the usage routes answer 404 and
the budget writes 409, each saying so; `GET /admin/budgets` still answers
from this process's memory.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from pydantic import BaseModel, ConfigDict, PositiveInt
from starlette.responses import Response

from engine_adapter.errors import InvalidRequest, NotFound
from server.auth import BUDGET_NAMES, Principal, authenticate, epoch_of, parse_when, require_admin
from server.errors import HTTPStatusError
from server.routes.docs import ERRORS
from server.usage.query import UsageQuery, as_csv, as_json, key_seen, parse_query, run_query
from server.usage.state import Usage

router = APIRouter()
AdminDep = Annotated[Principal, Depends(require_admin)]
AuthDep = Annotated[Principal, Depends(authenticate)]


def _usage(request: Request) -> Usage:
    usage: Usage = request.app.state.usage
    return usage


async def _answer(usage: Usage, q: UsageQuery) -> Response:
    db = usage.ledger.db
    assert db is not None
    async with db.begin() as conn:
        rows = await run_query(conn, q)
    if q.format == "csv":
        return Response(as_csv(rows), media_type="text/csv; charset=utf-8")
    import orjson

    return Response(orjson.dumps(as_json(q, rows)), media_type="application/json")


def _ledger_on(usage: Usage) -> None:
    if not usage.ledger.enabled:
        raise NotFound("the usage ledger is off on this gateway (--usage-db none)", code="ledger_off")


@router.get("/admin/usage", tags=["usage"], responses=ERRORS)
async def admin_usage(request: Request, admin: AdminDep) -> Response:
    usage = _usage(request)
    _ledger_on(usage)
    q = parse_query(request.query_params)
    if q.key is not None and q.key not in usage.keys():
        db = usage.ledger.db
        assert db is not None
        async with db.begin() as conn:
            seen = await key_seen(conn, q.key)
        if not seen:
            raise NotFound(f"no API key named `{q.key}`", param="key", code="key_not_found")
    return await _answer(usage, q)


@router.get("/v1/usage", tags=["usage"], responses=ERRORS)
async def own_usage(request: Request, principal: AuthDep) -> Response:
    usage = _usage(request)
    _ledger_on(usage)
    params = dict(request.query_params)
    if params.get("key") not in (None, principal.name or ""):
        raise NotFound("a key reads its own usage only; the admin API reads any key's", param="key")
    params["key"] = principal.name or ""
    return await _answer(usage, parse_query(params))


@router.get("/admin/budgets", tags=["usage"], responses=ERRORS)
async def budgets(request: Request, admin: AdminDep) -> dict[str, Any]:
    book = _usage(request).budgets
    return {"object": "list", "data": [book.report(k) for k in sorted(book.effective)]}


class BudgetUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens_per_day: PositiveInt | None = None
    tokens_per_month: PositiveInt | None = None
    requests_per_day: PositiveInt | None = None
    requests_per_month: PositiveInt | None = None
    expires_at: str | None = None


@router.put("/admin/budgets/{key}", tags=["usage"], responses=ERRORS)
async def set_budgets(
    request: Request, key: str, admin: AdminDep, body: Annotated[BudgetUpdate, Body()]
) -> dict[str, Any]:
    usage = _usage(request)
    if key not in usage.keys():
        raise NotFound(f"no API key named `{key}`", param="key", code="key_not_found")
    if not usage.ledger.enabled:
        raise HTTPStatusError(
            "budgets cannot be changed at run time with the usage ledger off (--usage-db none): "
            "edit the keys file instead", 409,
        )
    given = body.model_fields_set
    if not given:
        raise InvalidRequest(f"name at least one of {', '.join((*BUDGET_NAMES, 'expires_at'))}")
    values: dict[str, int | None] = {n: getattr(body, n) for n in BUDGET_NAMES if n in given}
    if "expires_at" in given:
        if body.expires_at is None:
            values["expires_at"] = None
        else:
            try:
                when = epoch_of(parse_when(body.expires_at))
            except ValueError as e:
                raise InvalidRequest(str(e), param="expires_at") from None
            values["expires_at"] = int(when) if when is not None else None
    await usage.ledger.set_budget(key, values)
    return usage.budgets.report(key)
