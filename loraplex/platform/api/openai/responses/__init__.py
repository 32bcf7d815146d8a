"""OpenAI's Responses API over the chat path: the routes (`serving_responses`), a request's
input items as a chat request (`input`), the response object and its stream events (`output`),
and the stored responses (`store`)."""
