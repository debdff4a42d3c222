"""What a node's `GET /v1/models` says, and which of its models an upstream
sends to (engine_adapter/routing/upstream.py runs it at each health check).

- `read_listing`: the node's models (cards whose `parent` is not listed) and
  its LoRA adapters (cards whose `parent` is one of them). A body that is not
  `{"data": [...]}` raises `NotListed` naming what is wrong.
- `choose` (`NAME=URL`, no `;model=*`): `;model=ID` if given; else the
  node's one model; else the model whose id is NAME; else, where the node
  says which model is which (`"kind": "generate" | "embed"` on its cards, as
  an npu-gateway node lists them) and it serves one generative model, that
  one, with /v1/embeddings sent to its embedding model. Anything else is
  refused with the ids the node lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Card = dict[str, Any]

# the start of every reason a listing gives (cleared once a check passes)
LISTING_REASONS = ("does not serve", "serves several", "/v1/models")


class NotListed(ValueError):
    """The node's /v1/models does not give what the upstream needs."""


@dataclass(frozen=True, slots=True)
class Listing:
    ids: tuple[str, ...]  # every id the node lists (models and adapters)
    cards: dict[str, Card] = field(default_factory=dict)  # every card by id
    models: dict[str, Card] = field(default_factory=dict)  # its models (not adapters): id -> card
    adapters: dict[str, tuple[str, str]] = field(default_factory=dict)  # adapter id -> (its model, root)


@dataclass(frozen=True, slots=True)
class Choice:
    card: Card  # the model generation APIs go to
    embed_id: str | None = None  # the model /v1/embeddings goes to, when not `card`'s


def read_listing(data: Any) -> Listing:
    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise NotListed('/v1/models is malformed (expected {"data": [...]})')
    cards = [m for m in data["data"] if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]]
    ids = tuple(m["id"] for m in cards)
    models = {m["id"]: m for m in cards if m.get("parent") not in ids}
    adapters = {m["id"]: (str(m["parent"]), str(m.get("root") or m["id"])) for m in cards if m["id"] not in models}
    return Listing(ids, {m["id"]: m for m in cards}, models, adapters)


def kind(card: Card) -> str:
    """`embed` where the node says so; `generate` otherwise."""
    return "embed" if card.get("kind") == "embed" else "generate"


def choose(listing: Listing, name: str, model: str | None) -> Choice:
    ids = listing.ids
    if model is not None:
        card = listing.cards.get(model)  # a model, or an adapter named on purpose
        if card is None:
            raise NotListed(f"does not serve {model!r} (it serves {', '.join(ids) or 'nothing'})")
        return Choice(card)
    models = list(listing.models.values())
    if not models:
        raise NotListed("does not serve any model (/v1/models is empty)")
    if len(models) == 1:
        return Choice(models[0])
    if name in listing.models:  # NAME=URL where NAME is one of the node's ids
        return Choice(listing.models[name])
    said = all("kind" in m for m in models)
    gens = [m for m in models if kind(m) == "generate"]
    embeds = [m["id"] for m in models if kind(m) == "embed"]
    if said and len(gens) == 1 and len(embeds) <= 1:
        return Choice(gens[0], embeds[0] if embeds else None)
    raise NotListed(
        f"serves several models ({', '.join(m['id'] for m in models)}): pick one with ;model=ID, "
        "or serve them all under their own ids with ;model=* (or --upstream URL without a name)"
    )
