"""What every route reaches: the engine, the server settings, the model names, the metrics, the
tenants and the chat template renderer."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import Request

from loraplex.platform.api.metrics.server_metrics import ServerMetrics
from loraplex.platform.api.openai.chat_template_renderer import ChatTemplateRenderer
from loraplex.platform.api.openai.sampling import RequestLimits
from loraplex.platform.api.settings import ServerSettings
from loraplex.platform.api.tenancy.model_resolver import ModelResolver, ServedModel
from loraplex.platform.api.tenancy.tenancy import Tenancy
from loraplex.platform.engine.protocol import EngineClient
from loraplex.platform.tokenizer.tokenizer import TokenIdsOnlyTokenizer, Tokenizer


@dataclass(frozen=True)
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    models: ModelResolver
    metrics: ServerMetrics
    tenancy: Tenancy
    chat_templates: ChatTemplateRenderer  # every chat template render, in killable processes

    async def tokenizer_of(self, served: ServedModel) -> Tokenizer | TokenIdsOnlyTokenizer:
        """The tokenizer requests on `served` are encoded and decoded with: its adapter's own
        when it stores one, else the base model's (read off the event loop)."""
        if served.lora_request is None:
            return self.engine.tokenizer
        return await asyncio.to_thread(self.engine.tokenizer_for, served.lora_request)

    @property
    def request_limits(self) -> RequestLimits:
        """What one request may ask of this server (`--max-n`, `--max-prompts-per-request`)."""
        return self.limits_for(self.engine.tokenizer)

    def limits_for(self, tokenizer: Tokenizer | TokenIdsOnlyTokenizer) -> RequestLimits:
        """`request_limits` for a request encoded with `tokenizer` (its token ids' range)."""
        return RequestLimits(
            vocab_size=tokenizer.vocab_size,
            max_n=self.settings.max_n,
            max_prompts_per_request=self.settings.max_prompts_per_request,
            max_model_len=self.engine.max_model_len,
        )


def server_state(request: Request) -> ServerState:
    """The app's ServerState (set by `build_app`)."""
    return request.app.state.loraplex
