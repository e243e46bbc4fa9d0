"""How a scripted answer's tokens become an output stream: where it stops, and why.

The "model" behind a rule says the rule's text and then its EOS, as a model that
learned the text by heart would. The request's sampling parameters bend that as they
bend a real model's output:

* a stop token id (``stop_token_ids``, or the EOS itself) in the text ends the output
  there, with that token, once ``min_tokens`` tokens came before it ("stop");
* ``max_tokens`` cuts the output wherever it falls ("length");
* where the text is over but the output may not end yet (fewer than ``min_tokens``
  tokens so far, or ``ignore_eos``), the text starts over: the EOS is held back, as a
  real engine suppresses it, and the next most likely thing is said again;
* a request that knows no EOS id ends "stop" on the text's last token.

Pure: the same arguments give the same stream, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from headwater.wire import FinishReason, SamplingParams


def answer_tokens(
    text_ids: Sequence[int], sampling: SamplingParams, eos_token_ids: Sequence[int] = ()
) -> Iterator[tuple[int, FinishReason | None]]:
    """The output for an answer of *text_ids* (at least one id): pairs of a token and
    the finish reason it carries (None but on the last). Needs ``max_tokens >= 1``."""
    if not text_ids:
        raise ValueError("an answer has at least one token")
    if sampling.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
    stop_ids = set(sampling.stop_token_ids)
    eos: int | None = None
    if not sampling.ignore_eos:
        stop_ids.update(eos_token_ids)
        eos = eos_token_ids[0] if eos_token_ids else None
    ends_without_eos = eos is None and not sampling.ignore_eos
    last = len(text_ids) - 1
    count = 0  # tokens emitted so far
    while True:
        for i, token in enumerate(text_ids):
            # May this token end the output? Only with min_tokens already before it.
            may_stop = count >= sampling.min_tokens
            count += 1
            if may_stop and token in stop_ids:
                yield token, FinishReason.STOP
                return
            if count >= sampling.max_tokens:
                yield token, FinishReason.LENGTH
                return
            if i == last and ends_without_eos and count >= sampling.min_tokens:
                yield token, FinishReason.STOP
                return
            yield token, None
        if eos is not None and count >= sampling.min_tokens:
            yield eos, FinishReason.STOP
            return
