"""Configuration of the simulated engine: one frozen object, the unit next to each field.

The defaults mirror Dynamo's mocker (block size 64, 16,384 GPU blocks, 256 sequences,
8,192 batched tokens) so that timings compare with the peer at the same load. Token ids
follow DeepSeek-V4: 0, 1, 2 and everything from 128,000 up are special, so the ordinary
range the mocker samples from is ``[3, 128000)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engines.config import EngineConfig


@dataclass(frozen=True, slots=True)
class MockerConfig(EngineConfig):
    """How fast the simulated engine runs, how big its KV cache is, what it emits.

    Fields with a ``help`` are command-line options of every command that runs a
    mocker (``--speedup-ratio``, ``--block-size``, ...). Raises ``ValueError`` on
    construction if a field is out of range.
    """

    #: Every simulated duration (prefill and decode steps) is divided by this. 1.0 is
    #: real-GPU speed; 1000 makes the engine nearly free, to measure the frontend alone.
    speedup_ratio: float = field(default=1.0, metadata={"help": "divide every step time by this"})
    #: Tokens per KV block (the unit of allocation and of prefix reuse).
    block_size: int = field(default=64, metadata={"help": "tokens per KV block"})
    #: KV blocks in the cache; the cache holds ``num_gpu_blocks * block_size`` tokens.
    num_gpu_blocks: int = field(default=16384, metadata={"help": "KV cache blocks"})
    #: Most sequences in the running batch at once; more wait in a FIFO queue.
    max_num_seqs: int = field(default=256, metadata={"help": "max running sequences"})
    #: Token budget of one scheduler step (decode tokens plus prefill chunks).
    max_num_batched_tokens: int = field(default=8192, metadata={"help": "token budget per step"})
    #: Lowest output token id emitted (inclusive). 0, 1, 2 are DeepSeek-V4 specials.
    output_token_low: int = 3
    #: Output token ids stay below this (exclusive). Ids >= 128,000 are specials.
    output_token_high: int = 128000
    #: Bytes of KV payload per prompt token, as reported by a transfer (bytes/token).
    kv_bytes_per_token: int = field(
        default=16, metadata={"help": "KV payload bytes per prompt token moved on a transfer"}
    )
    #: KV transfer bandwidth (bytes/s). Transports built for this engine
    #: (``InProcessKvTransfer(bandwidth=...)``) delay a pull by payload / bandwidth.
    kv_transfer_bandwidth: float = 10e9
    #: Seconds a prefill engine holds a finished prompt's KV for a decode worker to
    #: pull; after that the blocks are freed and the pull fails.
    kv_transfer_timeout: float = 30.0
    #: Answers end as a model's do: unless ``ignore_eos``, each request draws its length
    #: (tokens, EOS included) from its seed (:func:`.sampling.output_length`) and emits
    #: its first EOS id there, never before ``min_tokens``, finishing "stop"; else it
    #: runs to ``max_tokens`` ("length"). 0: none ends before ``max_tokens``.
    #: Default: chat answers' order of size (LMSYS-Chat-1M's average is ~215 tokens,
    #: ShareGPT's ~340), so a call without ``max_tokens`` ends in ~1.5 s at real speed
    #: rather than at the context length, minutes later.
    mean_output_tokens: int = field(
        default=256,
        metadata={
            "help": "mean answer length in tokens, after which a request emits EOS "
            "unless ignore_eos (0: every answer runs to max_tokens)"
        },
    )
    #: The shape of the length's lognormal. Answer lengths are right-skewed: many short
    #: answers and a long tail, which a lognormal fits with one parameter; σ = 1 puts the
    #: median at 0.61 × the mean and 1 answer in 100 past 6.2 × it. 0: every answer is
    #: exactly ``mean_output_tokens`` long.
    output_length_sigma: float = field(
        default=1.0, metadata={"help": "spread of the lognormal answer length (0: all equal)"}
    )
    #: Publish the KV cache's stored and evicted blocks for KV-aware routing
    #: (``headwater.wire.kv_events``); every committed block is then hashed at once.
    publish_kv_events: bool = True

    def __post_init__(self) -> None:
        if not self.speedup_ratio > 0:
            raise ValueError(f"speedup_ratio must be > 0, got {self.speedup_ratio}")
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.output_token_low < self.output_token_high:
            raise ValueError(
                "need 0 <= output_token_low < output_token_high, got "
                f"{self.output_token_low}, {self.output_token_high}"
            )
        if self.kv_bytes_per_token < 0:
            raise ValueError(f"kv_bytes_per_token must be >= 0, got {self.kv_bytes_per_token}")
        if not self.kv_transfer_bandwidth > 0:
            raise ValueError(f"kv_transfer_bandwidth must be > 0, got {self.kv_transfer_bandwidth}")
        if not self.kv_transfer_timeout > 0:
            raise ValueError(f"kv_transfer_timeout must be > 0, got {self.kv_transfer_timeout}")
        if self.mean_output_tokens < 0:
            raise ValueError(f"mean_output_tokens must be >= 0, got {self.mean_output_tokens}")
        if not 0 <= self.output_length_sigma <= 4:  # beyond, the tail is all max_tokens
            raise ValueError(
                f"output_length_sigma must be in [0, 4], got {self.output_length_sigma}"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the whole KV cache holds; no prompt may be longer."""
        return self.num_gpu_blocks * self.block_size
