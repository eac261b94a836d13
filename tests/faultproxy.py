"""`FaultProxy`: a loopback TCP proxy in front of the local S3 server that misbehaves on demand.

Object stores fail in a few typical ways under load, and s3fs plus our retry loop must survive
each. The proxy sits between s3fs and the ``s3_server`` fixture (moto) on 127.0.0.1 and switches,
live, between:

* ``cut(after_bytes, times)``: reset connections once they have carried ``after_bytes`` bytes from
  the client (a connection cut mid-upload); ``times`` cuts, or every connection until `heal`;
  `cut_open_connections` resets every open connection now;
* ``blackhole(seconds)``: accept and read everything, forward and answer nothing, until the time is
  up (the client's read timeout must fire); connections that lost bytes are closed when it ends;
* ``slowdown(k)``: answer the next ``k`` requests with ``503 SlowDown`` (S3's XML error body) without
  passing them on;
* ``bandwidth(bytes_per_s)``: forward at most that many bytes per second (both directions together).

Threads, not asyncio: each connection has two pump threads with short socket timeouts, so every
wait is bounded and `stop` ends everything within a second. Only the client-to-server direction
is parsed (HTTP/1.1 request framing: ``Content-Length`` or chunked bodies), to know where a
request starts; responses pass through untouched.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator, List, Optional, Tuple

__all__ = ["FaultProxy", "SLOWDOWN_BODY"]

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId></Error>"
)
_POLL_S = 0.1  # how often a blocked pump looks at the mode and the stop flag
_CHUNK = 64 * 1024


class _Requests:
    """HTTP/1.1 request framing of one client stream: reports when a new request head is complete."""

    def __init__(self) -> None:
        self.buffer = b""
        self.body_left = 0  # bytes of a Content-Length body still to come
        self.chunked = False
        self.opaque = False  # framing not understood: pass the rest through unparsed
        self.expects_continue = False  # the last head waits for "100 Continue" before its body

    def feed(self, data: bytes) -> List[Tuple[int, bytes]]:
        """The (offset in ``data`` just after the head, head) of each request head completed in ``data``."""
        heads: List[Tuple[int, bytes]] = []
        pos = 0
        while pos < len(data) and not self.opaque:
            if self.body_left:
                step = min(self.body_left, len(data) - pos)
                self.body_left -= step
                pos += step
                continue
            if self.chunked:
                pos = self._chunk(data, pos)
                continue
            self.buffer += data[pos:]
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                pos = len(data)
                continue
            head, rest = self.buffer[: end + 4], self.buffer[end + 4 :]
            pos = len(data) - len(rest)
            self.buffer = b""
            heads.append((pos, head))
            fields = {
                k.strip().lower(): v.strip()
                for k, v in (line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
            }
            self.expects_continue = fields.get(b"expect", b"").lower() == b"100-continue"
            if b"chunked" in fields.get(b"transfer-encoding", b"").lower():
                self.chunked, self._chunk_left, self._trailer = True, None, False
            else:
                try:
                    self.body_left = int(fields.get(b"content-length", b"0"))
                except ValueError:
                    self.opaque = True
        return heads

    def _chunk(self, data: bytes, pos: int) -> int:
        """Consume chunked body bytes from ``pos``; returns the new position."""
        if self._chunk_left:  # inside a chunk's data (+ its CRLF)
            step = min(self._chunk_left, len(data) - pos)
            self._chunk_left -= step
            return pos + step
        self.buffer += data[pos:]
        end = self.buffer.find(b"\r\n")
        if end < 0:
            return len(data)
        line, rest = self.buffer[:end], self.buffer[end + 2 :]
        self.buffer = b""
        pos = len(data) - len(rest)
        if self._trailer:  # trailer lines until an empty one
            if not line:
                self.chunked = False
            return pos
        try:
            size = int(line.split(b";")[0], 16)
        except ValueError:
            self.opaque = True
            return len(data)
        if size == 0:
            self._trailer = True
        else:
            self._chunk_left = size + 2
        return pos


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client, self.upstream = client, upstream
        self.sent = 0  # client -> server bytes since the connection opened or the cut mode was set
        self.dropped = False  # lost bytes to a black-hole: closed when it ends
        self.closed = threading.Event()

    def close(self, reset: bool = False) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for s in (self.client, self.upstream):
            try:
                if reset:  # an RST, as a cut network path or a killed load balancer gives
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                s.close()
            except OSError:
                pass


class FaultProxy:
    """A TCP proxy on 127.0.0.1 (a free port) to ``upstream`` (``"http://127.0.0.1:PORT"``)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError(f"FaultProxy proxies loopback only, got {upstream!r}.")
        self._upstream = ("127.0.0.1", int(port))
        self._lock = threading.Lock()
        self._conns: List[_Conn] = []
        self._threads: List[threading.Thread] = []
        self._stop = threading.Event()
        self._listener: Optional[socket.socket] = None
        self.endpoint = ""
        self.heal()
        self.requests = 0  # request heads seen
        self.slowdowns_sent = 0
        self.cuts_done = 0

    # ----------------------------------------------------------------- modes
    def heal(self) -> None:
        """Back to a healthy pass-through (ends every fault)."""
        with self._lock:
            self._cut_after: Optional[int] = None
            self._cuts_left: Optional[int] = None
            self._blackhole_until = 0.0
            self._slowdowns_left = 0
            self._rate: Optional[float] = None

    def cut(self, after_bytes: int = 0, times: Optional[int] = None) -> None:
        """Reset connections after ``after_bytes`` more client bytes each; ``times`` of them (None: all)."""
        with self._lock:
            self._cut_after, self._cuts_left = after_bytes, times
            for conn in self._conns:
                conn.sent = 0

    def cut_open_connections(self) -> int:
        """Reset every open connection now; returns how many."""
        with self._lock:
            conns = [c for c in self._conns if not c.closed.is_set()]
        for conn in conns:
            conn.close(reset=True)
        return len(conns)

    def blackhole(self, seconds: float) -> None:
        """Swallow all traffic, both ways, for ``seconds`` from now."""
        with self._lock:
            self._blackhole_until = time.monotonic() + seconds

    @property
    def blackholed(self) -> bool:
        return time.monotonic() < self._blackhole_until

    def slowdown(self, k: int) -> None:
        """Answer the next ``k`` requests with ``503 SlowDown``."""
        with self._lock:
            self._slowdowns_left = k

    def bandwidth(self, bytes_per_s: Optional[float]) -> None:
        """Forward at most ``bytes_per_s`` bytes a second in all (None: no cap)."""
        with self._lock:
            self._rate = bytes_per_s
            self._next_free = time.monotonic()

    # --------------------------------------------------------------- running
    def start(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        listener.settimeout(_POLL_S)
        self._listener = listener
        self.endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
        self._spawn(self._accept_loop)
        return self

    def stop(self) -> None:
        """Close everything; every thread ends within about a second."""
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.close()
        for thread in list(self._threads):
            thread.join(timeout=2)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"FaultProxy threads did not end: {alive}")

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"faultproxy-{target.__name__}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                self._close_after_blackhole()
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream, timeout=2)
            except OSError:
                client.close()
                continue
            for s in (client, upstream):
                s.settimeout(_POLL_S)
            conn = _Conn(client, upstream)
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed.is_set()] + [conn]
            self._spawn(self._client_to_server, conn)
            self._spawn(self._server_to_client, conn)

    def _close_after_blackhole(self) -> None:
        if self.blackholed:
            return
        with self._lock:
            lost = [c for c in self._conns if c.dropped and not c.closed.is_set()]
        for conn in lost:
            conn.close(reset=True)

    def _recv(self, conn: _Conn, sock: socket.socket) -> Optional[bytes]:
        """The next bytes from ``sock`` (b"" on a timeout), None when the connection is over."""
        if self._stop.is_set() or conn.closed.is_set():
            return None
        try:
            data = sock.recv(_CHUNK)
        except TimeoutError:
            return b""
        except OSError:
            return None
        return data or None

    def _throttle(self, n: int) -> None:
        with self._lock:
            rate = self._rate
            if rate is None:
                return
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / rate
            wait = start - now
        self._stop.wait(min(wait, 5.0))

    def _send(self, conn: _Conn, sock: socket.socket, data: bytes) -> bool:
        self._throttle(len(data))
        try:
            sock.sendall(data)
            return True
        except OSError:
            conn.close()
            return False

    def _chunks(self, conn: _Conn, sock: socket.socket) -> Iterator[bytes]:
        """What ``sock`` sends until the connection ends; nothing while black-holed (dropped unanswered)."""
        while True:
            data = self._recv(conn, sock)
            if data is None:
                conn.close()
                return
            if not data:
                continue
            if self.blackholed:
                conn.dropped = True
                continue
            yield data

    def _client_to_server(self, conn: _Conn) -> None:
        requests = _Requests()
        for data in self._chunks(conn, conn.client):
            heads = requests.feed(data)
            self.requests += len(heads)
            if heads and self._take_slowdown():
                self._answer_slowdown(conn, requests)
                return
            with self._lock:
                cut_after = self._cut_after
                if cut_after is not None and conn.sent + len(data) > cut_after:
                    if self._cuts_left is not None:
                        self._cuts_left -= 1
                        if self._cuts_left <= 0:
                            self._cut_after = self._cuts_left = None
                    self.cuts_done += 1
                    data = data[: max(0, cut_after - conn.sent)]
                    cut = True
                else:
                    cut = False
                conn.sent += len(data)
            if data and not self._send(conn, conn.upstream, data):
                return
            if cut:
                conn.close(reset=True)
                return

    def _take_slowdown(self) -> bool:
        with self._lock:
            if self._slowdowns_left <= 0:
                return False
            self._slowdowns_left -= 1
            self.slowdowns_sent += 1
            return True

    def _answer_slowdown(self, conn: _Conn, requests: _Requests) -> None:
        """Swallow the request's body (bounded: 5 s; none if it waits for "100 Continue") and answer
        503 SlowDown, then close: what S3 does when it throttles."""
        deadline = time.monotonic() + 5
        if not requests.expects_continue:
            while (requests.body_left or requests.chunked) and not requests.opaque and time.monotonic() < deadline:
                more = self._recv(conn, conn.client)
                if more is None:
                    break
                requests.feed(more)
        reply = (
            b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            + b"Content-Length: %d\r\n\r\n" % len(SLOWDOWN_BODY)
            + SLOWDOWN_BODY
        )
        try:
            conn.client.sendall(reply)
        except OSError:
            pass
        conn.close()

    def _server_to_client(self, conn: _Conn) -> None:
        for data in self._chunks(conn, conn.upstream):
            if not self._send(conn, conn.client, data):
                return


def proxied_options(proxy: FaultProxy, s3_server: dict, *, read_timeout_s: float = 2.0) -> dict:
    """s3fs storage options through ``proxy`` with short timeouts and no botocore retries, so a fault
    reaches s3fs (which still retries a request 5 times, 0.1 s to 0.8 s apart) and then the caller in
    seconds, not minutes."""
    options = dict(s3_server["storage_options"])
    return {
        **options,
        "client_kwargs": {**options["client_kwargs"], "endpoint_url": proxy.endpoint},
        "config_kwargs": {
            "connect_timeout": 1,
            "read_timeout": read_timeout_s,
            "retries": {"total_max_attempts": 1},
        },
        "skip_instance_cache": True,
    }
