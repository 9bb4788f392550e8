"""Session values in pieces (``nbdist.values``): signed as they pass, checked before unpickling,
large buffers received without a copy."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from nbdist import channel, values


def _send(value: Any, secret: str, cell: int) -> tuple[list[int], list[bytes], str]:
    """What a rank and its supervisor send for ``value``: sizes, pieces, signature."""
    segments = values.dumps(value)
    sizes = [s.nbytes for s in segments]
    mac = values.signer(secret, cell, sizes)
    pieces = []
    for seg in segments:
        for start in range(0, seg.nbytes, values.CHUNK):
            piece = bytes(seg[start:start + values.CHUNK])
            mac.update(piece)
            pieces.append(piece)
    return sizes, pieces, mac.hexdigest()


def test_a_large_array_arrives_whole_in_the_buffer_it_was_received_in() -> None:
    """A 20 MB array travels out of band in CHUNK pieces and is rebuilt on the received buffer
    (no copy), next to small values kept in the pickle stream."""
    secret = channel.new_secret()
    arr = np.arange(5_000_000, dtype=np.float32)
    value = {"weights": arr, "step": 3, "small": np.ones(10)}
    sizes, pieces, mac = _send(value, secret, 7)
    assert sizes[0] == arr.nbytes and len(sizes) == 2  # the array out of band, then the rest
    assert len(pieces) == -(-arr.nbytes // values.CHUNK) + 1
    receiver = values.Receiver(secret, 7, sizes)
    for piece in pieces:
        receiver.feed(piece)
    got = receiver.finish(mac)
    assert got["step"] == 3 and np.array_equal(got["small"], np.ones(10))
    assert np.array_equal(got["weights"], arr)
    base = got["weights"]
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    assert isinstance(base, (bytearray, memoryview))  # the receiver's buffer, not a copy


def test_a_large_bytes_value_is_received_into_the_bytes_object_it_becomes() -> None:
    """A 12 MB ``bytes`` value travels out of band and comes back as the very object its
    pieces were read into, in place or copied (the kernel holds it once, not twice)."""
    secret = channel.new_secret()
    value = bytes(range(256)) * (12 * 2**20 // 256)
    segments = values.dumps(value)
    assert values.bytes_segments(segments) == [0] and segments[0].nbytes == len(value)
    sizes, pieces, mac = _send(value, secret, 3)
    receiver = values.Receiver(secret, 3, sizes, [0])
    received = receiver._segments[0]
    for i, piece in enumerate(pieces):
        lent = receiver.next_buffer(len(piece))
        if lent is not None and i % 2:  # as the event server does: read into the buffer
            lent[:] = piece
            receiver.feed(lent)
        else:
            receiver.feed(piece)
    got = receiver.finish(mac)
    assert got is received and type(got) is bytes
    assert got == value and hash(got) == hash(value)
    with pytest.raises(ValueError, match="bytes segments"):
        values.Receiver(secret, 3, sizes, [1])  # the pickle stream itself is never bytes


def test_a_pulled_bytes_value_travels_out_of_band_too() -> None:
    """``%dist_pull``'s answer wraps the value with the rank's threads (``Pulled``); a large
    ``bytes`` value in it still travels out of band (the kernel's peak stays about 1x)."""
    from nbdist.protocol import Pulled

    value = bytes(range(256)) * (1 * 2**20 // 256)
    segments = values.dumps(Pulled(value, ["worker"]))
    assert values.bytes_segments(segments) == [0] and segments[0].nbytes == len(value)
    back = pickle.loads(segments[-1], buffers=segments[:-1])
    assert back == Pulled(value, ["worker"]) and type(back.value) is bytes


class Trap:
    """Unpickling it creates a directory: proof that it was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("tamper", ["a byte", "the sizes", "the cell", "the signature",
                                    "a non-ASCII signature", "no signature"])
def test_a_tampered_value_is_never_unpickled(tmp_path: Path, tamper: str) -> None:
    """Any change to the bytes, sizes, cell number or signature is refused before unpickling."""
    secret = channel.new_secret()
    trap = tmp_path / "unpickled"
    sizes, pieces, mac = _send([Trap(str(trap)), np.zeros(100_000, np.uint8)], secret, 2)
    assert len(sizes) == 2  # the array out of band, then the stream
    cell: Any = 2
    if tamper == "a byte":
        pieces[0] = pieces[0][:-1] + bytes([pieces[0][-1] ^ 1])
    elif tamper == "the sizes":
        sizes = [sizes[0] - 10, sizes[1] + 10]
    elif tamper == "the cell":
        cell = 3
    elif tamper == "the signature":
        mac = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    elif tamper == "a non-ASCII signature":
        mac = "é" * 64
    else:
        mac = None  # type: ignore[assignment]
    receiver = values.Receiver(secret, cell, sizes)
    for piece in pieces:
        receiver.feed(piece)
    with pytest.raises(values.SignatureError):
        receiver.finish(mac)
    assert not trap.exists()
    receiver = values.Receiver(secret, 2, [s.nbytes for s in values.dumps([Trap(str(trap))])])
    sizes, pieces, mac = _send([Trap(str(trap))], secret, 2)
    for piece in pieces:
        receiver.feed(piece)
    receiver.finish(mac)
    assert trap.exists()  # the same value, untampered, is unpickled


def test_more_or_fewer_bytes_than_announced_are_refused() -> None:
    """A piece past the announced sizes, or a value ended early, is a ValueError; bad sizes too."""
    secret = channel.new_secret()
    sizes, pieces, mac = _send(os.urandom(300_000), secret, 1)
    receiver = values.Receiver(secret, 1, sizes)
    with pytest.raises(ValueError, match="ended after 0 of"):
        receiver.finish(mac)
    for piece in pieces:
        receiver.feed(piece)
    with pytest.raises(ValueError, match="more than"):
        receiver.feed(b"x")
    for bad in ([], [-1], ["3"], [True], None, [1.5]):
        with pytest.raises(ValueError):
            values.Receiver(secret, 1, bad)


def test_pieces_read_in_place_are_not_copied_again() -> None:
    """A piece read into the buffer the receiver lent is taken as it is; others are copied."""
    secret = channel.new_secret()
    arr = np.arange(3_000_000, dtype=np.int32)
    sizes, pieces, mac = _send(arr, secret, 4)
    receiver = values.Receiver(secret, 4, sizes)
    for i, piece in enumerate(pieces):
        lent = receiver.next_buffer(len(piece))
        assert lent is not None and lent.nbytes == len(piece)
        if i % 2:
            lent[:] = piece  # what the event server does: read the piece there
            receiver.feed(lent)
        else:
            receiver.feed(piece)
    assert receiver.next_buffer(1) is None  # nothing more fits
    assert np.array_equal(receiver.finish(mac), arr)


def test_tensors_round_trip_with_their_sharing_and_grad() -> None:
    """Large CPU tensors travel as out-of-band arrays and come back equal, with requires_grad,
    and two tensors of one storage still share it; the rest goes through torch's pickling."""
    torch = pytest.importorskip("torch")
    secret = channel.new_secret()
    w = torch.randn(512, 256, requires_grad=True)
    flat = torch.arange(200_000, dtype=torch.int64)
    value = {
        "w": w, "tied": w, "flat": flat, "square": flat.view(400, 500),
        "bf16": torch.ones(100_000, dtype=torch.bfloat16),  # numpy has no bfloat16
        "part": flat[10:100_000],  # a view into part of a storage
        "small": torch.ones(3),
    }
    sizes, pieces, mac = _send(value, secret, 1)
    assert sorted(sizes[:-1]) == sorted([w.nbytes, flat.nbytes])  # out of band, once each
    receiver = values.Receiver(secret, 1, sizes)
    for piece in pieces:
        receiver.feed(piece)
    got = receiver.finish(mac)
    for key in value:
        assert torch.equal(got[key], value[key]), key
        assert got[key].dtype == value[key].dtype and got[key].shape == value[key].shape
    assert got["w"].requires_grad and not got["flat"].requires_grad
    assert got["tied"] is got["w"]
    got["flat"][0] = 99
    assert got["square"][0, 0] == 99  # still one storage


def test_shipped_code_keeps_its_filename() -> None:
    """Code nbdist pickles keeps its file name (cloudpickle >= 3.1.3 writes "<dynamic-code>"),
    so a rank's traceback names the user's file and line."""
    import pickle

    from nbdist import _pickling

    def where() -> str:
        return "here"

    back = pickle.loads(_pickling.dumps(where))
    assert back() == "here"
    assert back.__code__.co_filename == __file__
    segments = values.dumps(where)
    assert pickle.loads(segments[-1]).__code__.co_filename == __file__
