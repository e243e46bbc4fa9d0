"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``) on the chat pipeline, for the clients that speak it (Codex CLI,
the ``openai`` SDK's ``client.responses``).

Nothing here generates: a Responses request is translated into the chat pipeline's
request, and the pipeline's deltas into output items and the Responses event stream::

    models.py     the request and response bodies (validation, /openapi.json)
    translate.py  a Responses request → ParsedRequest (input items, tools, reasoning)
    format.py     the pipeline's deltas → a response object, or its event stream
    store.py      the stored responses, for previous_response_id and GET (per process)
    routes.py     the routes, served by the app's one request path

docs/api.md, "OpenAI Responses", lists every field and what headwater does with it.
"""
