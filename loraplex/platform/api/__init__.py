"""The HTTP API (FastAPI): `app.build_app` over an engine, grouped by what it serves:
`openai/` (the OpenAI-compatible routes, tools, the Responses API), `tenancy/` (keys, limits,
model names, adapters, admin), `metrics/` (Prometheus, health) and `dashboard/`. The process
entrypoints that serve it live in `loraplex.entrypoints`, which this package never imports."""
