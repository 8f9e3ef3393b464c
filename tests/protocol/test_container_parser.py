"""The incremental KVB1 parser (§4.3): the same layers as `Container`, whatever the pieces, and
each malformed header field refused at the octet that makes it malformed, not later."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_moq.errors import BadContainer
from kvsp_moq.protocol.container import Container, encode
from kvsp_moq.protocol.container_parser import ContainerParser

LAYERS = [(bytes([i]) * (8 + i), bytes([100 + i]) * (8 + i)) for i in range(4)]
DATA = encode(2, 3, LAYERS)
TABLE_END = 20 + 16 * len(LAYERS)

layer_lists = st.lists(st.tuples(st.binary(max_size=40), st.binary(max_size=40)), max_size=6)


def as_tuples(layers):
    return [(layer.index, bytes(layer.k), bytes(layer.v)) for layer in layers]


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in zip(bounds, bounds[1:])]


def refused_at(data: bytes, max_size: int) -> tuple[int, BadContainer]:
    """Feeds one octet at a time: the offset of the octet whose feed raised, and the error."""
    parser = ContainerParser(max_size=max_size)
    for i in range(len(data)):
        try:
            parser.feed(data[i:i + 1])
        except BadContainer as e:
            return i, e
    raise AssertionError("no octet was refused")


def refused_in_place_at(data: bytes, max_size: int) -> tuple[int, BadContainer]:
    """The same, receiving in place: the octet whose arrival (advance) raised."""
    parser = ContainerParser(max_size=max_size)
    parser.attach(bytearray(data))
    for i in range(len(data)):
        try:
            parser.advance(i + 1)
        except BadContainer as e:
            return i, e
    raise AssertionError("no octet was refused")


def patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


# ------------------------------------------------------------------ valid containers


@given(layer_lists, st.integers(0, 2**32 - 7), st.integers(0, 2**32 - 1),
       st.integers(0, 0xFFFF), st.lists(st.integers(0, 10_000), max_size=12))
def test_pieces_of_any_size_give_the_layers_container_gives(layers, first, tokens, codec, cuts):
    data = encode(first, tokens, layers, codec=codec)
    whole = Container(data)
    parser = ContainerParser(max_size=len(data))
    got = []
    for piece in pieces(data, cuts):
        got += parser.feed(piece)
    assert as_tuples(got) == as_tuples(whole.layers())
    assert parser.complete and parser.received == parser.total == len(data)
    c = parser.close()
    assert bytes(c.buffer) == data
    assert (c.version, c.flags, c.codec, c.first_layer, c.layer_count, c.token_count,
            c.data_offset, c.lengths()) == (whole.version, whole.flags, whole.codec,
                                            whole.first_layer, whole.layer_count,
                                            whole.token_count, whole.data_offset, whole.lengths())
    assert parser.close() is c


@given(layer_lists, st.lists(st.integers(0, 10_000), max_size=12))
def test_receiving_in_place_gives_the_same_layers(layers, cuts):
    data = encode(1, 5, layers)
    buffer = bytearray(len(data))
    parser = ContainerParser(max_size=len(data) + 100)
    parser.attach(buffer)
    got = []
    received = 0
    for piece in pieces(data, cuts):
        buffer[received:received + len(piece)] = piece
        received += len(piece)
        got += parser.advance(received)
    assert as_tuples(got) == as_tuples(Container(data).layers())
    c = parser.close()
    assert c.buffer.obj is buffer  # the layers are views of the caller's buffer: no copy


def test_a_layer_comes_out_with_its_last_octet_and_not_before():
    parser = ContainerParser(max_size=len(DATA))
    sizes = [k + v for k, v in Container(DATA).lengths()]
    layer_ends = [TABLE_END + sum(sizes[:i + 1]) for i in range(len(sizes))]
    seen = {}
    for i in range(len(DATA)):
        for layer in parser.feed(DATA[i:i + 1]):
            seen[layer.index] = i + 1
        if parser.header_parsed:
            assert parser.last_complete_layer == 2 + len(seen) - 1
    assert seen == {2 + i: end for i, end in enumerate(layer_ends)}


def test_the_header_fields_are_known_once_the_table_is_in():
    parser = ContainerParser(max_size=len(DATA))
    assert parser.feed(DATA[:TABLE_END - 1]) == [] and not parser.header_parsed
    assert parser.total is None
    parser.feed(DATA[TABLE_END - 1:TABLE_END])
    assert parser.header_parsed and parser.total == len(DATA)
    assert (parser.first_layer, parser.layer_count, parser.token_count, parser.codec) == (2, 4, 3, 1)


def test_the_buffer_comes_from_allocate():
    made = []

    def allocate(n):
        made.append(bytearray(n))
        return made[-1]

    parser = ContainerParser(max_size=len(DATA), allocate=allocate)
    parser.feed(DATA[:7])
    assert made == []  # nothing allocated before the table says how much
    parser.feed(DATA[7:])
    assert len(made) == 1 and parser.close().buffer.obj is made[0] and made[0] == DATA


def test_an_empty_container():
    data = encode(9, 0, [])
    parser = ContainerParser(max_size=20)
    assert parser.feed(data) == [] and parser.complete
    assert parser.close().layer_count == 0


# ------------------------------------------------------------------ malformed: the octet it is known at


@pytest.mark.parametrize("wrong_at", [0, 1, 2, 3])
def test_bad_magic_is_refused_at_its_first_wrong_octet(wrong_at):
    data = patched(DATA, wrong_at, b"X")
    at, e = refused_at(data, len(data))
    assert at == wrong_at and "magic" in str(e)
    assert refused_in_place_at(data, len(data))[0] == wrong_at


def test_an_unknown_version_is_refused_at_octet_4():
    data = patched(DATA, 4, b"\x02")
    at, e = refused_at(data, len(data))
    assert at == 4 and "version 2" in str(e)
    assert refused_in_place_at(data, len(data))[0] == 4


def test_first_layer_plus_count_past_2_to_the_32_is_refused_at_octet_15():
    data = patched(DATA, 8, struct.pack(">I", 0xFFFFFFFF))
    at, e = refused_at(data, len(data))
    assert at == 15 and "2^32" in str(e)
    assert refused_in_place_at(data, len(data))[0] == 15


def test_a_layer_count_whose_table_exceeds_max_size_is_refused_at_octet_15():
    data = patched(DATA, 12, struct.pack(">I", 1000))
    at, e = refused_at(data, len(data))
    assert at == 15 and "layer table of 1000 entries" in str(e)
    # where the table fits in max_size, octet 15 is fine
    assert ContainerParser(max_size=20 + 16 * 1000).feed(data[:16]) == []


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_a_k_length_past_max_size_is_refused_at_its_last_octet(layer):
    entry = 20 + 16 * layer
    data = patched(DATA, entry, struct.pack(">Q", 2**40))
    at, e = refused_at(data, len(data))
    assert at == entry + 7 and f"layer {2 + layer}" in str(e) and str(2**40) in str(e)
    assert refused_in_place_at(data, len(data))[0] == entry + 7


@pytest.mark.parametrize("layer", [0, 3])
def test_a_v_length_past_max_size_is_refused_at_its_last_octet(layer):
    entry = 20 + 16 * layer
    data = patched(DATA, entry + 8, struct.pack(">Q", len(DATA)))
    at, e = refused_at(data, len(data))
    assert at == entry + 15 and f"layer {2 + layer}" in str(e)
    assert refused_in_place_at(data, len(data))[0] == entry + 15


def test_lengths_that_add_up_past_max_size_are_refused_at_the_entry_that_overflows():
    # each section fits alone, but layer 1's end lies past max_size
    data = patched(DATA, 20 + 16 + 8, struct.pack(">Q", len(DATA) - TABLE_END - 16))
    at, e = refused_at(data, len(data))
    assert at == 20 + 16 + 15 and "layer 3" in str(e)


def test_a_trailing_octet_is_refused_as_it_arrives():
    data = DATA + b"\x00\x01"
    at, e = refused_at(data, len(data))
    assert at == len(DATA) and "trailing" in str(e)
    # fed at once, before the table is in: refused with the piece that carries it
    with pytest.raises(BadContainer, match="2 trailing"):
        ContainerParser(max_size=len(data)).feed(data)


def test_a_body_of_another_size_than_announced_is_refused_once_the_table_is_in():
    for data in (DATA + b"\x00", DATA[:-1]):
        at, e = refused_in_place_at(data, len(DATA) + 1)
        assert at == TABLE_END - 1 and "header announced" in str(e)


def test_a_body_larger_than_max_size_is_refused_on_attach():
    with pytest.raises(BadContainer, match="more than"):
        ContainerParser(max_size=len(DATA) - 1).attach(bytearray(len(DATA)))


@pytest.mark.parametrize("cut, known", [
    (0, "header alone needs 20"), (10, "header alone needs 20"),
    (TABLE_END - 1, f"table alone need {TABLE_END}"), (TABLE_END, f"announced {len(DATA)}"),
    (len(DATA) - 1, f"announced {len(DATA)}"),
])
def test_a_truncated_container_is_refused_on_close(cut, known):
    parser = ContainerParser(max_size=len(DATA))
    parser.feed(DATA[:cut])
    assert not parser.complete
    with pytest.raises(BadContainer, match="truncated") as e:
        parser.close()
    assert known in str(e.value)
    with pytest.raises(BadContainer):  # and stays refused
        parser.close()


def test_once_refused_every_call_is_refused():
    parser = ContainerParser(max_size=100)
    with pytest.raises(BadContainer) as first:
        parser.feed(b"KVB2")
    for call in (lambda: parser.feed(DATA), parser.close):
        with pytest.raises(BadContainer) as again:
            call()
        assert again.value is first.value


@given(st.binary(min_size=1, max_size=200), st.lists(st.integers(0, 400), max_size=8))
def test_any_octets_give_what_container_gives(data, cuts):
    """Whatever the octets and the pieces: the parser's verdict is Container's."""
    try:
        whole = Container(data)
    except BadContainer:
        whole = None
    parser = ContainerParser(max_size=len(data))
    got = []
    try:
        for piece in pieces(data, cuts):
            got += parser.feed(piece)
        c = parser.close()
    except BadContainer:
        assert whole is None
        return
    assert whole is not None and as_tuples(got) == as_tuples(whole.layers())
    assert bytes(c.buffer) == data


@given(st.sampled_from([
    (0, b"Z"), (2, b"Z"), (4, b"\x07"), (8, struct.pack(">I", 0xFFFFFFFF)),
    (12, struct.pack(">I", 5000)), (20, struct.pack(">Q", 2**50)),
    (20 + 16 * 3 + 8, struct.pack(">Q", 2**50)),
]), st.lists(st.integers(0, len(DATA)), max_size=6))
def test_in_random_pieces_the_refusal_comes_with_the_piece_holding_the_octet(bad, cuts):
    offset, value = bad
    data = patched(DATA, offset, value)
    at, _ = refused_at(data, len(data))
    parser = ContainerParser(max_size=len(data))
    start = 0
    for piece in pieces(data, cuts):
        end = start + len(piece)
        if end <= at:
            parser.feed(piece)
        else:
            with pytest.raises(BadContainer):
                parser.feed(piece)
            return
        start = end
    raise AssertionError("never refused")
