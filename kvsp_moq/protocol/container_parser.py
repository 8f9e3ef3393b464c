"""An incremental parser of KVB1 containers (KVSP §4.3), for bodies that arrive in pieces.

Sans-I/O, in the manner of h11: the caller receives octets however it likes and tells the
parser about them; the parser answers with the layers those octets completed, or refuses the
container with BadContainer as soon as an octet breaks a rule (the header and length-table
rules are `HeaderReader`'s, the ones `Container` applies).

    parser = ContainerParser(max_size=record.size)
    for piece in pieces:                    # copies each piece once into the block's buffer
        for layer in parser.feed(piece):    # Layer views into that buffer, in order
            ...
    container = parser.close()              # the input ended: the whole container, or refused

or, receiving in place (the octets are written into a buffer by someone else, a socket read):

    parser.attach(buffer)                   # the body is exactly len(buffer) octets
    for received in reads_into(buffer):
        for layer in parser.advance(received):
            ...

Once a call has raised BadContainer, every later call raises the same error.
"""

from __future__ import annotations

from collections.abc import Callable

from kvsp_moq.errors import BadContainer
from kvsp_moq.protocol.container import (
    HEADER_SIZE,
    Buffer,
    Container,
    HeaderReader,
    Layer,
)


def _bytes_view(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


class ContainerParser:
    """Takes a container's octets as they arrive; hands out layers as they complete.

    `max_size` bounds the container: a header or table announcing more is refused before
    anything is allocated for it. `allocate(n)` makes the buffer of n octets that `feed()`
    copies into (default bytearray); it is called once, when the length table is complete.
    """

    __slots__ = ("max_size", "received", "buffer", "_allocate", "_reader", "_head", "_given",
                 "_next", "_error", "_container")

    def __init__(self, *, max_size: int,
                 allocate: Callable[[int], Buffer] = bytearray) -> None:
        self.max_size = max_size
        #: Octets received so far.
        self.received = 0
        #: The container's buffer, once its size is known (the header and table are in);
        #: completed layers are views into it.
        self.buffer: memoryview | None = None
        self._allocate = allocate
        self._reader = HeaderReader(max_size)
        self._head = bytearray()  # octets fed before the buffer exists
        self._given: memoryview | None = None
        self._next = 0  # index of the next layer to hand out
        self._error: BadContainer | None = None
        self._container: Container | None = None

    # ------------------------------------------------------------------ input

    def feed(self, data: Buffer) -> list[Layer]:
        """Add the next octets (copied once); returns the layers they completed, in order."""
        if self._error is not None:
            raise self._error
        if self._given is not None:
            raise RuntimeError("feed() on a parser receiving in place (attach)")
        n = len(data)
        if not n:
            return []
        try:
            if self.buffer is None:
                self._head += data
                self.received += n
                reader = self._reader
                if not reader.read(self._head):
                    return []
                total = reader.total
                assert total is not None
                if len(self._head) > total:
                    raise BadContainer(f"{len(self._head) - total} trailing octets after "
                                       f"the last layer")
                buffer = _bytes_view(self._allocate(total))
                buffer[:len(self._head)] = self._head
                self.buffer = buffer
                self._head = bytearray()
            else:
                end = self.received + n
                if end > len(self.buffer):
                    raise BadContainer(f"{end - len(self.buffer)} trailing octets after "
                                       f"the last layer")
                self.buffer[self.received:end] = data
                self.received = end
        except BadContainer as e:
            self._error = e
            raise
        return self._complete()

    def attach(self, buffer: Buffer) -> None:
        """Receive in place: the body, exactly len(buffer) octets, will be written into
        `buffer` by someone else, and `advance()` told how many have arrived. A header that
        announces another size is refused once its length table is in."""
        if self._error is not None:
            raise self._error
        if self.received or self._head or self._given is not None:
            raise RuntimeError("attach() after octets were received")
        view = _bytes_view(buffer)
        if len(view) > self.max_size:
            self._error = BadContainer(f"a body of {len(view)} octets, more than the "
                                       f"{self.max_size} the container may have")
            raise self._error
        self._given = view

    def advance(self, received: int) -> list[Layer]:
        """The first `received` octets of the attached buffer are in; returns the layers
        completed since the last call, in order."""
        if self._error is not None:
            raise self._error
        given = self._given
        if given is None:
            raise RuntimeError("advance() without attach()")
        if not self.received <= received <= len(given):
            raise ValueError(f"received {received} octets, after {self.received}, "
                             f"of a {len(given)}-octet buffer")
        self.received = received
        if self.buffer is None:
            reader = self._reader
            try:
                if not reader.read(given[:received]):
                    return []
                if reader.total != len(given):
                    raise BadContainer(f"a body of {len(given)} octets, but the header "
                                       f"announced {reader.total}")
            except BadContainer as e:
                self._error = e
                raise
            self.buffer = given
        return self._complete()

    def close(self) -> Container:
        """The input has ended: the whole container (no copy), or BadContainer saying how
        much is missing. May be called again; returns the same container."""
        if self._container is not None:
            return self._container
        if self._error is not None:
            raise self._error
        reader = self._reader
        if self.buffer is None or self.received != reader.total:
            if reader.total is not None:
                need = f"the header announced {reader.total}"
            elif reader.table_end is not None:
                need = f"the header and layer table alone need {reader.table_end}"
            else:
                need = f"the header alone needs {HEADER_SIZE}"
            self._error = BadContainer(f"truncated: {self.received} octets, {need}")
            raise self._error
        self._container = Container.from_reader(self.buffer, reader)
        return self._container

    # ------------------------------------------------------------------ state

    def _complete(self) -> list[Layer]:
        reader = self._reader
        o, i, count = reader.offsets, self._next, reader.layer_count
        buf, received, first = self.buffer, self.received, reader.first_layer
        assert buf is not None
        out = []
        while i < count and o[2 * i + 2] <= received:
            out.append(Layer(first + i, buf[o[2 * i]:o[2 * i + 1]], buf[o[2 * i + 1]:o[2 * i + 2]]))
            i += 1
        self._next = i
        return out

    @property
    def header_parsed(self) -> bool:
        """Whether the header and the length table are in (and the buffer exists)."""
        return self.buffer is not None

    @property
    def total(self) -> int | None:
        """The container's size, once the length table is in."""
        return self._reader.total

    @property
    def complete(self) -> bool:
        """Whether every octet the header announced has arrived."""
        return self.buffer is not None and self.received == self._reader.total

    @property
    def version(self) -> int:
        return self._reader.version

    @property
    def flags(self) -> int:
        return self._reader.flags

    @property
    def codec(self) -> int:
        return self._reader.codec

    @property
    def first_layer(self) -> int:
        return self._reader.first_layer

    @property
    def layer_count(self) -> int:
        return self._reader.layer_count

    @property
    def token_count(self) -> int:
        return self._reader.token_count

    @property
    def last_complete_layer(self) -> int:
        """The number of the last layer handed out (first_layer - 1 when none)."""
        return self._reader.first_layer + self._next - 1
