"""`build_app`: the FastAPI app of the OpenAI-compatible server over one EngineClient."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from loraplex import __version__, envs
from loraplex.platform.api.dashboard import serving_dashboard
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.metrics import serving_health
from loraplex.platform.api.metrics.server_metrics import ServerMetrics
from loraplex.platform.api.openai import (
    serving_chat,
    serving_completion,
    serving_models,
    serving_tokenize,
)
from loraplex.platform.api.openai.chat_template_renderer import ChatTemplateRenderer
from loraplex.platform.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.platform.api.openai.responses import serving_responses
from loraplex.platform.api.openai.responses.store import ResponseStore
from loraplex.platform.api.read_deadlines import BodyReadDeadline
from loraplex.platform.api.request_body import body_schemas
from loraplex.platform.api.settings import ServerSettings
from loraplex.platform.api.state import ServerState
from loraplex.platform.api.tenancy import serving_adapters, serving_admin
from loraplex.platform.api.tenancy.adapter_service import AdapterService
from loraplex.platform.api.tenancy.auth import AuthMiddleware
from loraplex.platform.api.tenancy.model_resolver import ModelResolver, TenantModelResolver
from loraplex.platform.api.tenancy.tenancy import Tenancy
from loraplex.platform.engine.protocol import EngineClient

logger = logging.getLogger(__name__)

ROUTERS = (serving_models.router, serving_completion.router, serving_chat.router,
           serving_health.router, serving_adapters.router, serving_admin.router,
           serving_dashboard.router, serving_tokenize.router,
           serving_responses.router)  # fmt: skip
# The JSON bodies routes read themselves (`read_json_model`), documented in /openapi.json.
BODY_MODELS: tuple[type[BaseModel], ...] = (
    CompletionRequest,
    ChatCompletionRequest,
    serving_admin.TenantCreateRequest,
    *serving_adapters.BODY_MODELS,
    *serving_tokenize.BODY_MODELS,
    *serving_responses.BODY_MODELS,
)


def build_app(
    engine: EngineClient,
    settings: ServerSettings | None = None,
    models: ModelResolver | None = None,
) -> FastAPI:
    """The app; it starts the engine thread on startup and stops it on shutdown.

    `models` resolves OpenAI `model` names (default: the engine's served model name, and each
    tenant's adapters from the registry under `settings.data_dir`).
    """
    settings = settings or ServerSettings()
    metrics = ServerMetrics(engine.served_model_name, engine.max_model_len)
    engine.add_timing_observer(metrics.observe)
    admin_key = settings.admin_key or envs.admin_key()
    tenancy = Tenancy(
        settings.data_dir or envs.data_dir(), settings.tenants_file, admin_key,
        settings.adapter_registry,
    )  # fmt: skip
    engine.add_timing_observer(tenancy.metrics.observe)
    for warning in tenancy.startup_warnings(settings.host):
        logger.warning("%s", warning)
    state = ServerState(
        engine=engine,
        settings=settings,
        models=models or TenantModelResolver(engine.served_model_name, tenancy.registry),
        metrics=metrics,
        tenancy=tenancy,
        chat_templates=ChatTemplateRenderer(
            settings.chat_template_workers, settings.chat_template_timeout_s
        ),
    )
    dashboard = serving_dashboard.Dashboard(state, admin_key)
    responses = ResponseStore(settings.data_dir or envs.data_dir())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            await state.chat_templates.start()
            await serving_admin.sync_weights(state)
            await app.state.adapters.register_stored()
            await app.state.adapters.register_lora_modules()
            async with dashboard.stats.sampling(), app.state.adapters.following_registry():
                yield
        finally:
            await state.chat_templates.close()
            engine.shutdown()
            dashboard.sessions.close()
            tenancy.close()
            responses.close()

    app = FastAPI(title="loraplex", version=__version__, lifespan=lifespan)
    app.state.loraplex = state
    app.state.adapters = AdapterService(state)
    app.state.responses = responses
    app.state.dashboard = dashboard
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.add_middleware(AuthMiddleware, tenancy=tenancy, sessions=dashboard.sessions)
    app.add_middleware(BodyReadDeadline, timeout_s=settings.request_read_timeout_s)
    _document_bodies(app)
    return app


def _document_bodies(app: FastAPI) -> None:
    """Add BODY_MODELS' schemas to the OpenAPI document (routes refer to them by name)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(body_schemas(BODY_MODELS))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
