"""`build_app`: the FastAPI app of the OpenAI-compatible server over one AsyncEngine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplex import __version__
from loraplex.platform.api import serving_chat, serving_completion, serving_health, serving_models
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.metrics import ServerMetrics
from loraplex.platform.api.state import ModelResolver, ServerSettings, ServerState
from loraplex.platform.engine.async_engine import AsyncEngine

ROUTERS = (serving_models.router, serving_completion.router, serving_chat.router,
           serving_health.router)  # fmt: skip


def build_app(
    engine: AsyncEngine,
    settings: ServerSettings | None = None,
    models: ModelResolver | None = None,
) -> FastAPI:
    """The app; it starts the engine thread on startup and stops it on shutdown.

    `models` resolves OpenAI `model` names (default: only the engine's served model name).
    """
    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine.served_model_name)
    engine.add_timing_observer(metrics.observe)
    state = ServerState(
        engine=engine,
        settings=settings,
        models=models or ModelResolver(engine.served_model_name),
        metrics=metrics,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="loraplex", version=__version__, lifespan=lifespan)
    app.state.loraplex = state
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app
