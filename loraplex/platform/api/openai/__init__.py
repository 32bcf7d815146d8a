"""The OpenAI-compatible API: request and response bodies (`protocol`), body to
`SamplingParams` (`sampling`), the chat, completions, models and tokenize routes, tool calls
(`tools/`), the Responses API (`responses/`), and what the generation routes share: their
engine requests (`request_streams`), whole responses (`choices`), server-sent events (`sse`)
and ids (`ids`)."""
