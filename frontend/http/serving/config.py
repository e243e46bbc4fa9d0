"""The configuration of headwater's HTTP server: hypercorn's, plus the settings of its fixes."""

from __future__ import annotations

from hypercorn.config import BYTES, SECONDS, Config


class ServerConfig(Config):
    """hypercorn's :class:`~hypercorn.config.Config` with the fields that
    :class:`~frontend.http.serving.tcp_server.HeadwaterTCPServer` reads.

    Like hypercorn's own fields these are class-level defaults that an instance
    overrides by assignment (``Config.from_mapping`` works too); each server reads them
    from the config it was given, so two servers in one process may differ.
    """

    #: Seconds a socket write may wait for the client to take its bytes; a client that
    #: takes none of them in that time is treated as gone and its connection dropped.
    write_timeout: float = 30 * SECONDS
    #: Bytes asked of the socket per read: hypercorn's ``MAX_RECV``, enough for a
    #: request head and a short body.
    read_size: int = 2**16 * BYTES
    #: Bytes asked per read once a read of a connection has filled :attr:`read_size`:
    #: the connection carries large bodies (a 40k-token prompt is ~240 kB). Kept under
    #: 1 MiB for glibc's sake (see ``HeadwaterTCPServer._read_data``).
    read_size_large: int = 2**18 * BYTES
