"""The client's LookupStream calls: long-lived bidirectional streams that each carry one
lookup at a time, so a gather pays a message round trip on an open stream instead of
grpcio's setup of a new call (docs/ple.md has the measurements)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
from backport.v1 import ple_pb2

from services.ple_offload.errors import TableUnavailableError
from services.ple_offload.lookup_wire import LOOKUP_STREAM_METHOD


class LookupStreams:
    """Idle streams of one channel, reused by whichever thread gathers next. Thread-safe.

    A thread takes a stream for one request and its reply and then puts it back, so a
    stream never has two requests outstanding and replies cannot be mismatched. Threads
    that gather at the same time get a stream each (opened when none is idle) instead of
    queueing behind one lock: a prefill lookup of several ms then does not hold up another
    thread's decode step, just as concurrent unary calls do not. An engine that gathers
    from one thread uses one stream.

    Streams carry no per-message deadline, so each is opened with a deadline of twice the
    lookup timeout and is used only while at least one timeout is left: every lookup
    gets at least `timeout_s`, and a hung service fails it with DEADLINE_EXCEEDED within
    2 x `timeout_s`. A busy client so opens a new stream about every `timeout_s`."""

    def __init__(self, channel: grpc.Channel, address: str) -> None:
        # Replies stay wire bytes, read in place by `lookup_wire.decode_lookup_reply`.
        self._open_call = channel.stream_stream(
            LOOKUP_STREAM_METHOD, request_serializer=ple_pb2.LookupRequest.SerializeToString,
            response_deserializer=None)
        self._address = address
        self._lock = threading.Lock()
        self._idle: list[_LookupStream] = []
        self._is_closed = False

    def lookup(self, request: ple_pb2.LookupRequest, timeout_s: float) -> bytes:
        """The reply to `request`, as LookupResponse wire bytes. Raises grpc.RpcError as a
        unary Lookup would (the stream that failed is dropped; the next lookup opens
        another), or TableUnavailableError when the service ended the stream without
        answering."""
        stream = self._take(timeout_s)
        try:
            reply = stream.round_trip(request)
        except StopIteration:
            stream.close()
            raise TableUnavailableError(f"PLE service at {self._address} ended a lookup "
                                        "stream without answering") from None
        except BaseException:
            stream.close()
            raise
        with self._lock:
            if not self._is_closed:
                self._idle.append(stream)
                return reply
        stream.close()
        return reply

    def close(self) -> None:
        """Half-closes every idle stream; a stream in use is closed when its lookup ends.
        Closing the channel afterwards cancels whatever the service has not ended."""
        with self._lock:
            self._is_closed = True
        self.close_idle()

    def close_idle(self) -> None:
        """Half-closes every idle stream, so the next lookups open new ones: after the
        service restarted, each idle stream is dead and would fail one lookup."""
        with self._lock:
            idle, self._idle = self._idle, []
        for stream in idle:
            stream.close()

    def _take(self, timeout_s: float) -> _LookupStream:
        with self._lock:
            while self._idle:
                stream = self._idle.pop()
                if stream.seconds_left() >= timeout_s:
                    return stream
                stream.close()
        return _LookupStream(self._open_call, lifetime_s=2 * timeout_s)


class _LookupStream:
    """One LookupStream call. Requests go into a queue that the call's request iterator
    drains on grpc's sending thread; replies are read in order on the caller's thread."""

    def __init__(self, open_call: grpc.StreamStreamMultiCallable, lifetime_s: float) -> None:
        self._requests: queue.SimpleQueue[ple_pb2.LookupRequest | None] = queue.SimpleQueue()
        self._expires_at = time.monotonic() + lifetime_s
        self._replies: Iterator[bytes] = open_call(_until_none(self._requests),
                                                   timeout=lifetime_s)

    def seconds_left(self) -> float:
        return self._expires_at - time.monotonic()

    def round_trip(self, request: ple_pb2.LookupRequest) -> bytes:
        """Raises StopIteration when the service ended the stream without an error."""
        self._requests.put(request)
        return next(self._replies)

    def close(self) -> None:
        """Ends the request iterator, so grpc's sending thread exits and the service,
        seeing no more requests, ends the call."""
        self._requests.put(None)


def _until_none(requests: queue.SimpleQueue[ple_pb2.LookupRequest | None],
                ) -> Iterator[ple_pb2.LookupRequest]:
    while (request := requests.get()) is not None:
        yield request
