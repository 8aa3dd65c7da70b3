"""One HTTP/2 connection of kvstack's gRPC server (`kvstack.http.grpc_server`): frames in, calls out to their
handlers (`kvstack.http.grpc_stream`), responses back; the behaviour is listed on `Connection`.

Our settings: ``STREAM_WINDOW`` per stream and ``CONNECTION_WINDOW`` for the connection, refilled as DATA
arrives; frames up to ``MAX_FRAME_IN``; header lists up to ``h2_headers.MAX_HEADER_LIST``; encoded header
blocks up to ``MAX_HEADER_BLOCK`` in at most ``MAX_CONTINUATIONS`` CONTINUATION frames.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
from typing import TYPE_CHECKING, cast

from kvstack.http import h2_frames as h2
from kvstack.http.grpc_status import Status
from kvstack.http.grpc_stream import GrpcStream
from kvstack.http.h2_headers import MAX_HEADER_LIST, HeaderReader

if TYPE_CHECKING:
    from kvstack.http.grpc_server import GrpcServer

__all__ = ["Connection"]

log = logging.getLogger(__name__)

STREAM_WINDOW = 1 << 20  # what each stream may send before our WINDOW_UPDATE (SETTINGS_INITIAL_WINDOW_SIZE)
CONNECTION_WINDOW = 16 << 20  # the same for the whole connection
MAX_FRAME_IN = 1 << 20  # SETTINGS_MAX_FRAME_SIZE we announce
MAX_HEADER_BLOCK = 256 << 10  # encoded bytes of one header block, CONTINUATIONs included
MAX_CONTINUATIONS = 64


class Connection(asyncio.Protocol):
    """One client connection: HTTP/2 frames in, calls out to handlers, responses back.

    HTTP/2 behaviour: the client preface (anything else: GOAWAY PROTOCOL_ERROR, close); SETTINGS (acked;
    the peer's INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE applied; our HEADER_TABLE_SIZE bounds the hpack decoder
    once acked); PING acked; HEADERS with CONTINUATION (padding and priority skipped; blocks bounded);
    DATA carrying gRPC messages that may span frames; END_STREAM both ways; RST_STREAM; GOAWAY from the peer
    (no new streams expected, close when the last ends) and from us (graceful close); unknown frame types
    ignored. Flow control: the peer's windows are honoured for our DATA (waiting data resumes on
    WINDOW_UPDATE), and ours are refilled on receipt, so the peer never waits for us. A response finished
    while the client is still sending is followed by RST_STREAM NO_ERROR (RFC 9113 §8.1). A connection
    error is answered by GOAWAY with its code; a stream error by RST_STREAM. Reading pauses while the
    transport's write buffer is over its high-water mark.
    """

    def __init__(self, server: GrpcServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._headers = HeaderReader(server.header_table_size)
        self._streams: dict[int, GrpcStream] = {}
        self._blocked: dict[int, GrpcStream] = {}  # streams with DATA waiting for a window
        self._buffered = 0  # bytes in the blocked streams' queues
        self._out: list[bytes | memoryview] = []
        self._flush_scheduled = False
        self._receiving = False
        self._closed = False
        self._buf = bytearray()
        self._need = len(h2.PREFACE)
        self._preface_done = False
        self._settings_seen = False
        self._header_block: tuple[int, int, list[bytes]] | None = None  # (stream, flags, pieces)
        self._highest_stream = 0  # the highest stream id the client opened
        self._last_accepted = 0  # the highest stream id handed to a handler (GOAWAY's last stream id)
        self._goaway_sent = False
        self._peer_goaway = False
        self._send_window = h2.DEFAULT_WINDOW
        self._recv_window = CONNECTION_WINDOW
        self._recv_unacked = 0
        self._peer_initial_window = h2.DEFAULT_WINDOW
        self._peer_max_frame = h2.DEFAULT_MAX_FRAME
        self._write_paused = False

    # -- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._server._connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ours = {
            h2.MAX_CONCURRENT_STREAMS: self._server.max_concurrent_streams,
            h2.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
            h2.MAX_FRAME_SIZE: MAX_FRAME_IN,
            h2.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST,
        }
        if self._server.header_table_size != h2.DEFAULT_HEADER_TABLE:
            ours[h2.HEADER_TABLE_SIZE] = self._server.header_table_size
        self._out.append(h2.settings(ours))
        self._out.append(h2.window_update(0, CONNECTION_WINDOW - h2.DEFAULT_WINDOW))
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        buf = self._buf
        if buf:
            buf += data
            if len(buf) < self._need:
                return
            data = bytes(buf)
            buf.clear()
        self._receiving = True
        try:
            pos = self._read(data)
        except h2.ProtocolError as exc:
            self._fail(exc.code, str(exc))
            return
        except Exception:  # a bug here must end this connection, not every read after it
            log.exception("HTTP/2 connection failed")
            self._fail(h2.ErrorCode.INTERNAL_ERROR, "internal error")
            return
        finally:
            self._receiving = False
        if self._closed:
            return
        if pos < len(data):
            self._buf = bytearray(memoryview(data)[pos:])
        if self._recv_unacked >= CONNECTION_WINDOW // 2:
            self._out.append(h2.window_update(0, self._recv_unacked))
            self._recv_window += self._recv_unacked
            self._recv_unacked = 0
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server._connection_gone(self)
        self._out.clear()
        streams = list(self._streams.values())
        self._streams.clear()
        self._blocked.clear()
        self._buffered = 0
        for st in streams:
            st._reset()

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None and not self._closed:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._closed:
            self._transport.resume_reading()

    # -- frames in -----------------------------------------------------------------------------------
    def _read(self, data: bytes) -> int:
        """Handle every whole frame in ``data``; the offset of the first byte not handled."""
        pos, end = 0, len(data)
        if not self._preface_done:
            n = len(h2.PREFACE)
            if data[:n] != h2.PREFACE[: min(n, end)]:
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "not an HTTP/2 connection preface")
            if end < n:
                return 0
            self._preface_done = True
            pos = n
        unpack = h2.FRAME_HEADER.unpack_from
        while end - pos >= 9:
            hi, lo, kind, flags, sid = unpack(data, pos)
            length = (hi << 16) | lo
            if length > MAX_FRAME_IN:
                raise h2.ProtocolError(h2.ErrorCode.FRAME_SIZE_ERROR, f"frame of {length} bytes")
            stop = pos + 9 + length
            if stop > end:
                self._need = 9 + length
                return pos
            payload = data[pos + 9 : stop]
            pos = stop
            sid &= 0x7FFFFFFF
            if self._header_block is not None and kind != h2.CONTINUATION:
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "header block interrupted")
            if not self._settings_seen and (kind != h2.SETTINGS or flags & h2.ACK):
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "the first frame is not SETTINGS")
            if kind == h2.DATA:
                self._on_data(flags, sid, payload)
            elif kind == h2.HEADERS:
                self._on_headers(flags, sid, payload)
            elif kind == h2.SETTINGS:
                self._on_settings(flags, sid, payload)
            elif kind == h2.WINDOW_UPDATE:
                self._on_window_update(sid, payload)
            elif kind == h2.PING:
                if sid or length != 8:
                    raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "malformed PING")
                if not flags & h2.ACK:
                    self._out.append(h2.frame(h2.PING, h2.ACK, 0, payload))
            elif kind == h2.RST_STREAM:
                self._on_rst_stream(sid, payload)
            elif kind == h2.CONTINUATION:
                self._on_continuation(flags, sid, payload)
            elif kind == h2.GOAWAY:
                if sid:
                    raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "GOAWAY on a stream")
                self._peer_goaway = True
                self._close_if_done()
            elif kind == h2.PRIORITY:
                if not sid:
                    raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "PRIORITY on stream 0")
                if length != 5:
                    self._out.append(h2.rst_stream(sid, h2.ErrorCode.FRAME_SIZE_ERROR))
            elif kind == h2.PUSH_PROMISE:
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            if self._closed:
                return end
        self._need = 9
        return pos

    def _idle(self, sid: int) -> bool:
        """A stream id the client has not opened (frames on it other than HEADERS are a protocol error)."""
        return sid > self._highest_stream or not sid & 1

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        n = len(payload)
        self._recv_window -= n
        if self._recv_window < 0:
            raise h2.ProtocolError(h2.ErrorCode.FLOW_CONTROL_ERROR, "DATA beyond the connection window")
        self._recv_unacked += n
        st = self._streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream already closed: frames in flight are dropped (counted for the connection)
        if st.remote_closed:
            self._stream_error(st, h2.ErrorCode.STREAM_CLOSED)
            return
        st._recv_window -= n
        if st._recv_window < 0:
            self._stream_error(st, h2.ErrorCode.FLOW_CONTROL_ERROR)
            return
        st._recv_unacked += n
        if st._recv_unacked >= STREAM_WINDOW // 2 and not flags & h2.END_STREAM:
            self._out.append(h2.window_update(sid, st._recv_unacked))
            st._recv_window += st._recv_unacked
            st._recv_unacked = 0
        if flags & h2.PADDED:
            payload = _unpad(payload)
        if payload and not st.closed:
            st._receive(payload)
        if flags & h2.END_STREAM:
            self._remote_end(st)

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid & 1:
            raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        if flags & h2.PADDED:
            payload = _unpad(payload)
        if flags & h2.PRIORITY_FLAG:
            if len(payload) < 5:
                raise h2.ProtocolError(h2.ErrorCode.FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        if flags & h2.END_HEADERS:
            self._on_header_block(flags, sid, payload)
        else:
            self._header_block = (sid, flags, [payload])

    def _on_continuation(self, flags: int, sid: int, payload: bytes) -> None:
        if self._header_block is None or self._header_block[0] != sid:
            raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "CONTINUATION without its HEADERS")
        pieces = self._header_block[2]
        pieces.append(payload)
        if len(pieces) > MAX_CONTINUATIONS or sum(map(len, pieces)) > MAX_HEADER_BLOCK:
            raise h2.ProtocolError(h2.ErrorCode.ENHANCE_YOUR_CALM, "header block too large")
        if flags & h2.END_HEADERS:
            first_flags = self._header_block[1]
            self._header_block = None
            self._on_header_block(first_flags, sid, b"".join(pieces))

    def _on_header_block(self, flags: int, sid: int, block: bytes) -> None:
        path, http_method, content_type, metadata = self._headers.read(block)
        ended = bool(flags & h2.END_STREAM)
        st = self._streams.get(sid)
        if st is not None:  # trailers from the client
            if not ended or st.remote_closed:
                self._stream_error(st, h2.ErrorCode.PROTOCOL_ERROR)
            else:
                self._remote_end(st)
            return
        if sid <= self._highest_stream:
            return  # a stream closed already (frames in flight after a reset)
        self._highest_stream = sid
        if self._goaway_sent or len(self._streams) >= self._server.max_concurrent_streams:
            self._out.append(h2.rst_stream(sid, h2.ErrorCode.REFUSED_STREAM))
            return
        if http_method != "POST" or not content_type.startswith("application/grpc"):
            # Not a gRPC request: answered in HTTP (405, 415) as the gRPC protocol says.
            code = b"405" if http_method != "POST" else b"415"
            head = h2.literal_indexed_name(h2.STATIC_STATUS, code)
            self._out.append(h2.frame(h2.HEADERS, h2.END_HEADERS | h2.END_STREAM, sid, head))
            if not ended:
                self._out.append(h2.rst_stream(sid, h2.ErrorCode.NO_ERROR))
            return
        self._last_accepted = sid
        st = GrpcStream(self, sid, path, list(metadata), self._peer_initial_window, STREAM_WINDOW)
        self._streams[sid] = st
        factory = self._server.methods.get(path)
        if factory is None:
            st.remote_closed = ended
            st.finish(Status.UNIMPLEMENTED, f"unknown method {path}")
            return
        try:
            st._handler = factory(st)
        except Exception:
            st.remote_closed = ended
            st._handler_failed("its factory")
            return
        if ended:
            self._remote_end(st)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & h2.ACK:
            if payload:
                raise h2.ProtocolError(h2.ErrorCode.FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            self._headers.settings_acked()
            return
        self._settings_seen = True
        for key, value in h2.parse_settings(payload):
            if key == h2.INITIAL_WINDOW_SIZE:
                if value > h2.MAX_WINDOW:
                    raise h2.ProtocolError(h2.ErrorCode.FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value}")
                delta = value - self._peer_initial_window
                self._peer_initial_window = value
                for st in self._streams.values():
                    st._send_window += delta
                    if st._send_window > h2.MAX_WINDOW:
                        raise h2.ProtocolError(h2.ErrorCode.FLOW_CONTROL_ERROR, "stream window overflow")
            elif key == h2.MAX_FRAME_SIZE:
                if not h2.DEFAULT_MAX_FRAME <= value <= h2.LARGEST_FRAME:
                    raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self._peer_max_frame = value
            elif key == h2.ENABLE_PUSH and value > 1:
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, f"ENABLE_PUSH {value}")
        self._out.append(h2.SETTINGS_ACK)
        for st in list(self._blocked.values()):
            self._pump(st)

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise h2.ProtocolError(h2.ErrorCode.FRAME_SIZE_ERROR, "WINDOW_UPDATE not 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not sid:
            if not increment:
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > h2.MAX_WINDOW:
                raise h2.ProtocolError(h2.ErrorCode.FLOW_CONTROL_ERROR, "connection window overflow")
            for blocked in list(self._blocked.values()):
                if self._send_window <= 0:
                    break
                self._pump(blocked)
            return
        st = self._streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return
        if not increment:
            self._stream_error(st, h2.ErrorCode.PROTOCOL_ERROR)
            return
        st._send_window += increment
        if st._send_window > h2.MAX_WINDOW:
            self._stream_error(st, h2.ErrorCode.FLOW_CONTROL_ERROR)
        elif st._pending:
            self._pump(st)

    def _on_rst_stream(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise h2.ProtocolError(h2.ErrorCode.FRAME_SIZE_ERROR, "RST_STREAM not 4 bytes")
        st = self._streams.get(sid)
        if st is None:
            if self._idle(sid):
                raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            return
        self._forget(st)
        st._reset()

    def _remote_end(self, st: GrpcStream) -> None:
        st.remote_closed = True
        if st.closed:
            return  # finished, its last DATA waiting for the window: forgotten once sent
        if st._rbuf is not None:
            st._end_by_server(Status.INTERNAL, "the request ended inside a message")
            return
        try:
            st._handler.on_end()
        except Exception:
            st._handler_failed("on_end")

    # -- frames out ----------------------------------------------------------------------------------
    def _queue(self, st: GrpcStream, payload: bytes) -> None:
        """DATA that does not go out at once: queued on its stream, sent as windows open."""
        limit = self._server.max_buffered_bytes
        if self._buffered + len(payload) > limit:
            self._drop_pending(st)  # the call fails: its trailers go out now, not after its data
            st._end_by_server(
                Status.RESOURCE_EXHAUSTED, f"the client leaves over {limit} bytes of responses unread"
            )
            return
        if st._pending is None:
            st._pending = collections.deque()
        st._pending.append(memoryview(payload))
        self._buffered += len(payload)
        self._blocked[st.id] = st
        self._pump(st)

    def _pump(self, st: GrpcStream) -> None:
        """Send what the windows allow of ``st``'s queued DATA, and its trailers once it is all out."""
        pending = st._pending
        if pending is None:
            return
        out = self._out
        while pending:
            room = min(st._send_window, self._send_window, self._peer_max_frame)
            if room <= 0:
                return
            chunk = pending[0]
            if len(chunk) <= room:
                pending.popleft()
                piece = chunk
            else:
                piece, pending[0] = chunk[:room], chunk[room:]
            n = len(piece)
            st._send_window -= n
            self._send_window -= n
            self._buffered -= n
            out.append(h2.frame_header(h2.DATA, 0, st.id, n))
            out.append(piece)
        st._pending = None
        del self._blocked[st.id]
        if st._trailers is not None:
            out.append(st._trailers)
            st._trailers = None
            self._local_done(st)
        if not self._receiving:
            self._schedule_flush()

    def _local_done(self, st: GrpcStream) -> None:
        """``st``'s trailers are written: ask a client still sending to stop (RFC 9113 §8.1), forget it."""
        if not st.remote_closed:
            self._out.append(h2.rst_stream(st.id, h2.ErrorCode.NO_ERROR))
        self._forget(st)

    def _stream_error(self, st: GrpcStream, code: h2.ErrorCode) -> None:
        self._out.append(h2.rst_stream(st.id, code))
        self._forget(st)
        st._reset()

    def _forget(self, st: GrpcStream) -> None:
        self._streams.pop(st.id, None)
        self._drop_pending(st)
        self._close_if_done()

    def _drop_pending(self, st: GrpcStream) -> None:
        if self._blocked.pop(st.id, None) is not None and st._pending:
            self._buffered -= sum(len(p) for p in st._pending)
        st._pending = None
        st._trailers = None

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._transport is None or self._closed:
            return
        out = self._out
        if out:
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        if self._goaway_sent or self._peer_goaway:
            self._close_if_done()

    # -- ending the connection -------------------------------------------------------------------------
    def _close_if_done(self) -> None:
        if (self._goaway_sent or self._peer_goaway) and not self._streams and not self._receiving:
            if self._out:
                self._schedule_flush()
            elif self._transport is not None and not self._closed:
                self._transport.close()

    def shutdown(self) -> None:
        """Graceful close: GOAWAY (NO_ERROR, the last stream taken), finish the calls in flight, close."""
        if self._closed or self._goaway_sent:
            return
        self._goaway_sent = True
        self._out.append(h2.goaway(self._last_accepted, h2.ErrorCode.NO_ERROR))
        self._flush()
        self._close_if_done()

    def abort(self) -> None:
        """Reset every call left (RST_STREAM CANCEL, ``on_reset``) and close."""
        if self._closed:
            return
        for st in list(self._streams.values()):
            self._stream_error(st, h2.ErrorCode.CANCEL)
        self._flush()
        self._closed = True
        if self._transport is not None:
            self._transport.close()

    def _fail(self, code: h2.ErrorCode, message: str) -> None:
        """A connection error: GOAWAY with ``code``, close, reset every call."""
        log.debug("HTTP/2 connection error %s: %s", code.name, message)
        self._out.clear()
        self._closed = True
        if self._transport is not None:
            debug = message.encode("utf-8", "replace")[:256]
            self._transport.write(h2.goaway(self._last_accepted, code, debug))
            self._transport.close()
        streams = list(self._streams.values())
        self._streams.clear()
        self._blocked.clear()
        for st in streams:
            st._reset()

    @property
    def open_streams(self) -> int:
        return len(self._streams)


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise h2.ProtocolError(h2.ErrorCode.PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1 : len(payload) - payload[0]]
