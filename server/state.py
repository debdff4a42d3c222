"""What the routes share: the served models and their pools, settings,
metrics. Lives in the app's lifespan state, never in module globals."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_adapter.errors import InvalidRequest, ModelNotFound
from engine_adapter.pool import WorkerPool
from server.settings import Settings

if TYPE_CHECKING:
    from server.limits import Limits


@dataclass(slots=True)
class ServedModel:
    id: str
    pool: WorkerPool
    root: str
    parent: str | None = None  # set for aliases: the model id they point to
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def kind(self) -> str:
        return self.pool.card.kind


class Gateway:
    def __init__(self, settings: Settings, pools: list[tuple[WorkerPool, tuple[str, ...], str]]) -> None:
        """`pools`: (pool, served names, root path) per model."""
        self.settings = settings
        self.pools = [p for p, _, _ in pools]
        self.models: dict[str, ServedModel] = {}
        for pool, names, root in pools:
            primary = names[0]
            for i, name in enumerate(names):
                self.models[name] = ServedModel(
                    id=name, pool=pool, root=root, parent=None if i == 0 else primary
                )
        self.draining = False
        self.started_at = time.time()
        self.limits: Limits

    def begin_drain(self) -> None:
        """SIGTERM: /ready fails at once; new requests get 503 + Retry-After."""
        self.draining = True
        for p in self.pools:
            p.stop_accepting()

    def resolve(self, name: str | None, kind: str = "generate") -> ServedModel:
        if not name:
            candidates = [m for m in self.models.values() if m.kind == kind and m.parent is None]
            if len(candidates) == 1:
                return candidates[0]
            raise InvalidRequest("missing required parameter: model", param="model")
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"The model `{name}` does not exist.", param="model")
        if model.kind != kind:
            what = "an embedding" if model.kind == "embed" else "a generation"
            raise InvalidRequest(
                f"The model `{name}` is {what} model and does not support this endpoint.", param="model"
            )
        return model
