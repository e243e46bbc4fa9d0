"""What a decode worker's reader spends receiving a prompt's simulated KV, two ways.

A 40k-token prompt's KV (``kv_bytes_per_token`` 16) is one ~640 KB ``kv_data`` piece. A
writer thread sends such pieces over a local socket pair; the reader (this thread)
receives and decodes them as a plane connection does, and its own CPU time is what is
printed, in microseconds per piece (one JSON object):

* ``whole``: the piece decoded whole: each read's bytes appended to the frame buffer,
  then a bytes object made of the payload by msgpack (what the decoder does with a
  layout it does not recognise, and did with every piece before);
* ``payload_buffer``: each read's payload bytes copied into the decoder's reused
  payload buffer, the piece yielded as a view of it (what it does now).

::

    .venv/bin/python scripts/measure/kv_receive.py [--pieces 2000] [--bytes 640000]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
import threading
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from headwater.wire import codec
from headwater.wire.codec import MAX_READ, FrameDecoder, encode_parts, read_size
from headwater.wire.frames import KvData

RECEIVE_SIZE = 64 * 1024  # PlaneConfig.receive_size


def receive(pieces: int, size: int, way: str) -> float:
    """Reader CPU microseconds per piece, receiving *pieces* pieces of *size* bytes."""
    frame = b"".join(encode_parts(KvData("t" * 32, memoryview(bytes(size)), False)))
    reader, writer = socket.socketpair()
    for sock in (reader, writer):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MAX_READ)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_READ)

    def send() -> None:
        for _ in range(pieces):
            writer.sendall(frame)

    thread = threading.Thread(target=send)
    decoder = FrameDecoder()
    got = 0
    # "whole": the decoder does not recognise the piece's layout, as it recognised none before.
    whole = mock.patch.object(codec, "_piece_head", return_value=None)
    with whole if way == "whole" else contextlib.nullcontext():
        thread.start()
        start = time.thread_time()
        while got < pieces:
            frames = decoder.feed(reader.recv(read_size(decoder, RECEIVE_SIZE)))
            got += len(frames)
            del frames
        spent = time.thread_time() - start
    thread.join()
    reader.close()
    writer.close()
    return spent / pieces * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=2000, help="pieces per way")
    parser.add_argument("--bytes", type=int, default=640_000, help="payload bytes per piece")
    args = parser.parse_args()
    ways = ("whole", "payload_buffer")
    receive(10, args.bytes, "whole")  # warm the allocator
    results = {way: round(receive(args.pieces, args.bytes, way), 1) for way in ways}
    print(json.dumps({"bytes": args.bytes, "us_per_piece": results}))


if __name__ == "__main__":
    main()
