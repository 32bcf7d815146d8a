"""Tenancy: who may call, what they see, how much they may use.

- `tenant_store`: `Tenant` and `TenantStore`, the tenants and their API keys (YAML + SQLite).
- `tenancy`: `Tenancy`, the aggregate a server holds (tenants, the adapter registry, limits,
  per-tenant metrics), and `Caller`, who sent a request.
- `auth`: the ASGI middleware that maps a key to a `Caller` and admits requests.
- `limits`: per-tenant concurrency and tokens-per-minute caps, as requests carry them to the
  engine loop, which holds them for every API process (`engine/tenant_limits.py`).
- `model_resolver`: an OpenAI `model` name in a tenant's namespace -> `ServedModel`.
- `adapter_service` and `serving_adapters`: a tenant's adapters (upload, register, delete).
- `serving_admin`: tenant management, for the admin key.
"""
