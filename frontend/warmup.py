"""Warm-up: each piece of work a short request does on the event loop, once, at start.

The first call of a path pays one-off costs that later calls do not: the encoder's
set-up on the loop thread (13-40 ms measured for the first short prompt, which is
encoded inline), the request models' and the template's first use, the detokenizer's
first decode. Left to the first request, the longest of them is a stall of the serving
loop, on the dashboard of a server that has just started. :meth:`Frontend.run` calls
:func:`warm_up` before the stall detector starts, so the server's record starts clean.

Nothing here counts: no metric is observed and no worker is asked (there may be none
yet), only the loop-side parts run, on sample requests of each endpoint.
"""

from __future__ import annotations

import time
from typing import Any, Final

import orjson

from frontend.http.schema import parse_request
from frontend.pipeline import Pipeline
from frontend.postprocess import TextPostprocessor
from frontend.preprocess.messages import completion_prompt

#: One short request per text endpoint, as a client would send them.
_SAMPLES: Final[dict[str, dict[str, Any]]] = {
    "chat": {
        "model": "warm-up",
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 16,
        "stop": ["\n\n"],
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "completions": {"model": "warm-up", "prompt": "Once upon a time", "max_tokens": 16},
}


async def warm_up(pipeline: Pipeline) -> float:
    """Warm the tokenizer pool (its thread and the loop's inline encode), then parse,
    render, encode and detokenize a sample request of each endpoint on this thread;
    returns the seconds spent."""
    start = time.perf_counter()
    await pipeline.pool.warm_up()
    tokenizer = pipeline.tokenizer
    for endpoint, body in _SAMPLES.items():
        parsed = parse_request(orjson.loads(orjson.dumps(body)), endpoint, pipeline.limits)
        if endpoint == "chat":
            text = pipeline.template.render(
                parsed.messages or [], chat_template_kwargs=parsed.chat_template_kwargs
            )
        else:
            text = str(completion_prompt(parsed.prompt))
        ids = list(tokenizer.encode_ids(text))
        if tokenizer.eos_token_id is not None:  # an answer's end, which is not text
            ids.append(tokenizer.eos_token_id)
        post = TextPostprocessor(
            tokenizer.decode, stops=parsed.stop, special_ids=tokenizer.special_ids
        )
        for token in ids:
            post.step([token])
        post.finish()
    return time.perf_counter() - start
