"""Chat tool calling: what `tools` / `tool_choice` ask for (`tool_calls`), `tool_choice: "auto"`
with enforced calls (`tool_auto`), calls streamed as OpenAI streams them (`tool_call_stream`),
and how each family of chat templates writes calls (`tool_parsers/`)."""
