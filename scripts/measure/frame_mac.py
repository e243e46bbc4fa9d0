"""What the session's frame tags cost: encode + decode of typical frames, with and without.

With a plane secret every frame after the handshake carries an HMAC-SHA256 tag under
the session's key (headwater/wire/session.py). This times, in one process, the codec's
encode and decode of the frames a request moves (a one-token chunk, an ack, a 40k-token
request, a 640 KB kv_data piece), each with and without a session, and prints one JSON
object with the microseconds per frame and the difference::

    .venv/bin/python scripts/measure/frame_mac.py [--repeat 20000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headwater.wire import Ack, Chunk, GenerateRequest, SamplingParams
from headwater.wire.codec import FrameDecoder, encode_parts
from headwater.wire.frames import Frame, KvData
from headwater.wire.session import derive_session

FRAMES: dict[str, Frame] = {
    "chunk_1_token": Chunk("req-0123456789", [1234]),
    "ack": Ack("req-0123456789"),
    "request_40k_tokens": GenerateRequest(
        "req-0123456789", "deepseek-v4", list(range(40_000)), SamplingParams(max_tokens=256)
    ),
    "kv_data_640k": KvData("t-1", memoryview(bytes(640_000)), False),
}


def per_frame_us(frame: Frame, repeat: int, tagged: bool) -> float:
    """Encode and decode *frame* *repeat* times (a session's two ends when *tagged*)."""
    ends = [
        derive_session(b"s" * 32, side, b"c" * 32, b"n" * 32, ("a", "b", ""), ("c", "d", ""))
        for side in ("client", "server")
    ]
    send = ends[0].send if tagged else None
    decoder = FrameDecoder(mac=ends[1].receive if tagged else None)

    def one() -> None:
        decoder.feed(b"".join(encode_parts(frame, mac=send)))

    one()
    start = time.perf_counter()
    for _ in range(repeat):
        one()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=20_000, help="frames per measurement")
    args = parser.parse_args()
    results = {}
    for name, frame in FRAMES.items():
        repeat = args.repeat if "640k" not in name and "40k" not in name else args.repeat // 50
        plain = min(per_frame_us(frame, repeat, False) for _ in range(3))
        tagged = min(per_frame_us(frame, repeat, True) for _ in range(3))
        results[name] = {
            "plain_us": round(plain, 2),
            "tagged_us": round(tagged, 2),
            "tag_cost_us": round(tagged - plain, 2),
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
