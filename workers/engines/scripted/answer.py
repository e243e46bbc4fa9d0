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
* a request that knows no EOS id ends "stop" on the text's last token;
* a prompt that ends with the text's first tokens is continued after them
  (:func:`continued`), as such a model goes on from where its text was cut: what a
  migrated request's prompt is (the tokens generated before its stream broke appended).

Pure: the same arguments give the same stream, token for token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from headwater.wire import FinishReason, SamplingParams


def continued(prompt: Sequence[int], text_ids: Sequence[int], most: int) -> int:
    """How many of *text_ids*' first tokens *prompt* ends with, up to *most*: where a
    model that learned the text by heart goes on from (0: from the start)."""
    if not prompt:
        return 0
    last, n = prompt[-1], len(prompt)
    for k in range(min(most, n, len(text_ids)), 0, -1):
        if text_ids[k - 1] == last and list(prompt[n - k :]) == list(text_ids[:k]):
            return k
    return 0


def answer_tokens(
    text_ids: Sequence[int],
    sampling: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    start: int = 0,
) -> Iterator[tuple[int, FinishReason | None]]:
    """The output for an answer of *text_ids* (at least one id), going on after its first
    *start* tokens (:func:`continued`): pairs of a token and the finish reason it carries
    (None but on the last). Needs ``max_tokens >= 1``, and *start* below the text's
    length, or at it when the request knows an EOS id (only that is left to say)."""
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
    if not 0 <= start <= last + (eos is not None):
        raise ValueError(f"start {start} is past the text ({len(text_ids)} tokens)")
    count = 0  # tokens emitted so far
    while True:
        for i, token in enumerate(text_ids[start:], start=start):
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
        start = 0  # said again from the start
