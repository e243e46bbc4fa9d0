"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``)
on the chat pipeline, for the clients that speak it (Claude Code, the ``anthropic`` SDK).

Nothing here generates: a Messages request is translated into the chat pipeline's
request, and the pipeline's deltas into Anthropic's content blocks and events::

    models.py     the request and response bodies (validation, /openapi.json)
    translate.py  a Messages request → ParsedRequest (messages, tools, thinking)
    format.py     the pipeline's deltas → a Message, or its event stream
    errors.py     Anthropic's error body and statuses, on these routes only
    routes.py     the routes, served by the app's one request path

docs/api.md, "Anthropic Messages", lists every field and what headwater does with it.
"""
