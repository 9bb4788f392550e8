"""A session cell's value on its way to the notebook: pickled in segments, sent in pieces,
signed as it passes, checked before it is unpickled.

On the rank, the value is pickled with protocol 5, its large buffers (what pickles its data
as a ``PickleBuffer``, as numpy arrays do, from ``OUT_OF_BAND_BYTES``) kept out of band: the
value's *segments* are those buffers, then the pickle stream. torch pickles a tensor's data
in band (through ``torch.save``, about five times the tensor's size in the kernel to load it):
a large CPU tensor that owns its memory goes as a numpy array instead, out of band, and comes
back as a tensor over the received buffer. The rank writes them to its
supervisor in pieces of at most ``CHUNK`` bytes; the supervisor forwards each piece as it
comes, as a binary block on the event channel (``nbdist.events``, protocol 3). Nothing on the
way holds the whole value: the kernel holds a few pieces in flight, then the value itself.

The supervisor signs what passes with HMAC-SHA256 under the session's secret, over the cell's
number, the segments' sizes and every byte in order, and sends the signature after the last
piece. The driver writes the pieces into buffers of the announced sizes and computes the same
HMAC as they arrive; it unpickles only once the signature matches, and the out-of-band buffers
then become the arrays' memory without a copy: a pulled array costs the kernel about its size.

Standard library only (cloudpickle inside :func:`dumps`): the rank side imports it too.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import io
import mmap
import pickle
import sys
from typing import Any

from nbdist.protocol import Pulled

#: Most bytes in one piece of a value (one frame to the supervisor, one block to the driver).
CHUNK = 4 * 2**20
#: Buffers at least this large travel out of band (smaller ones stay in the pickle stream).
OUT_OF_BAND_BYTES = 64 * 1024
#: Segments at least this large are received into anonymous maps (``Receiver``).
MAPPED_BYTES = 2**20


class SignatureError(ValueError):
    """The value's signature does not match what arrived: it is not unpickled."""


class _Bytes:
    """A large ``bytes`` value on its way out: pickled out of band (pickle keeps ``bytes`` in
    the stream, and never asks ``reducer_override`` about them), so that the notebook can
    receive it straight into the ``bytes`` object it returns (:class:`Receiver`)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _bytes, (pickle.PickleBuffer(self.data),)


def _bytes(buf: Any) -> bytes:
    """A ``bytes`` value as it left the rank: the buffer itself when it is one (no copy)."""
    return buf if type(buf) is bytes else bytes(buf)


def bytes_segments(segments: list[memoryview]) -> list[int]:
    """Which of ``dumps``'s segments are ``bytes`` objects (the receiver makes them so)."""
    return [i for i, seg in enumerate(segments[:-1]) if type(seg.obj) is bytes]


def dumps(value: Any) -> list[memoryview]:
    """The value's segments: its large buffers out of band, then the pickle stream."""
    from nbdist._pickling import Pickler as Base

    if type(value) is bytes and len(value) >= OUT_OF_BAND_BYTES:
        value = _Bytes(value)
    elif type(value) is Pulled and type(value.value) is bytes \
            and len(value.value) >= OUT_OF_BAND_BYTES:  # %dist_pull's value, with its threads
        value = Pulled(_Bytes(value.value), value.threads)

    torch = sys.modules.get("torch")  # only if the rank's code imported it
    arrays: dict[tuple[int, str], Any] = {}  # a storage's flat array: tensors sharing it share it

    # cloudpickle has no type information: its Pickler is Any to mypy.
    class Pickler(Base):
        def reducer_override(self, obj: Any) -> Any:
            if torch is not None and type(obj) is torch.Tensor:
                flat = _flat_array(torch, obj, arrays)
                if flat is not None:
                    return _tensor, (flat, tuple(obj.shape), obj.requires_grad)
            return super().reducer_override(obj)

    buffers: list[memoryview] = []

    def in_band(buf: pickle.PickleBuffer) -> bool:
        try:
            raw = buf.raw()
        except BufferError:  # not contiguous: pickle copies it into the stream
            return True
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True
        buffers.append(raw)
        return False

    with io.BytesIO() as f:
        Pickler(f, protocol=5, buffer_callback=in_band).dump(value)
        body = f.getvalue()
    return [*buffers, memoryview(body)]


def _flat_array(torch: Any, t: Any, arrays: dict[tuple[int, str], Any]) -> Any:
    """A 1-D numpy view of a large CPU tensor's memory, or None where torch's own pickling is
    needed: a view into part of a storage (pickled with the storage, as torch does), other
    devices and layouts, dtypes numpy lacks (bfloat16), a lazily conjugated or negated one."""
    if (t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous()
            or t.is_conj() or t.is_neg() or t.storage_offset() != 0
            or t.untyped_storage().nbytes() != t.nbytes or t.nbytes < OUT_OF_BAND_BYTES):
        return None
    key = (t.data_ptr(), str(t.dtype))
    if key not in arrays:
        try:
            arrays[key] = t.detach().reshape(-1).numpy()
        except (TypeError, RuntimeError):  # no numpy dtype for it
            return None
    return arrays[key]


def _tensor(flat: Any, shape: tuple[int, ...], requires_grad: bool) -> Any:
    """A tensor over ``flat``'s memory, as it left the rank (how a large tensor is unpickled)."""
    import torch

    return torch.from_numpy(flat).view(shape).requires_grad_(requires_grad)


def signer(secret: str, cell: int, sizes: list[int]) -> hmac.HMAC:
    """The running HMAC of one value; ``update`` it with every piece, in order."""
    head = f"{cell}:{','.join(map(str, sizes))}:".encode()
    return hmac.new(bytes.fromhex(secret), head, hashlib.sha256)


class Receiver:
    """The driver's end of one value: buffers of the announced sizes, filled piece by piece.

    Raises ``ValueError`` for sizes that are not a list of counts, ``MemoryError`` if the
    kernel cannot hold them.
    """

    def __init__(self, secret: str, cell: int, sizes: object, as_bytes: object = ()) -> None:
        if not isinstance(sizes, list) or not sizes or any(
                type(s) is not int or s < 0 for s in sizes):
            raise ValueError(f"a value announced with sizes {sizes!r}")
        if not isinstance(as_bytes, (list, tuple)) or any(
                type(i) is not int or not 0 <= i < len(sizes) - 1 for i in as_bytes):
            raise ValueError(f"a value announced with bytes segments {as_bytes!r}")
        self.size = sum(sizes)
        self._mac = signer(secret, cell, sizes)
        # Anonymous maps, not bytearrays: their pages are mapped as the pieces are written,
        # not zeroed in a pass of their own first. An array unpickled out of band lives in one.
        # A ``bytes`` value (``_Bytes``) is received into the bytes object it will be. A small
        # segment (a session cell's usual value) is a bytearray: a map costs two system calls
        # that lock the kernel's address space against every other thread's page faults.
        self._segments: list[bytearray | mmap.mmap | bytes] = [
            _fresh_bytes(s) if i in as_bytes else mmap.mmap(-1, s) if s >= MAPPED_BYTES
            else bytearray(s) for i, s in enumerate(sizes)]
        self._views = [_writable(seg) for seg in self._segments]
        self._seg = 0  # the segment being filled
        self._pos = 0  # bytes of it filled
        self._got = 0
        self._lent: memoryview | None = None  # where the next piece is being read in place

    def next_buffer(self, n: int) -> memoryview | None:
        """Where the next ``n`` bytes go, if they fall in one segment (the rank cuts its pieces
        so): the event server reads the piece there, and hands it to :meth:`feed`."""
        while self._seg < len(self._segments) and self._pos == len(self._segments[self._seg]):
            self._seg, self._pos = self._seg + 1, 0
        if self._seg == len(self._segments) or self._pos + n > len(self._segments[self._seg]):
            return None
        self._lent = self._views[self._seg][self._pos:self._pos + n]
        return self._lent

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        """The next piece; ``ValueError`` if it goes past the announced sizes."""
        view = memoryview(piece).cast("B")
        if self._got + view.nbytes > self.size:
            raise ValueError(f"more than the {self.size} bytes announced")
        self._got += view.nbytes
        self._mac.update(view)
        lent, self._lent = self._lent, None
        if piece is lent:  # read in place by the server: nothing to copy
            self._pos += view.nbytes
            return
        while view.nbytes:
            seg = self._views[self._seg]
            if self._pos == len(seg):
                self._seg, self._pos = self._seg + 1, 0
                continue
            take = min(len(seg) - self._pos, view.nbytes)
            seg[self._pos:self._pos + take] = view[:take]
            self._pos += take
            view = view[take:]

    def finish(self, mac: object) -> Any:
        """The value, once every byte arrived and ``mac`` is its signature.

        Raises ``ValueError`` if bytes are missing, :class:`SignatureError` if the signature
        does not match (nothing is unpickled then), and what unpickling raises.
        """
        if self._got != self.size:
            raise ValueError(f"the value ended after {self._got} of its {self.size} bytes")
        if not isinstance(mac, str) or not mac.isascii() or not hmac.compare_digest(
                mac, self._mac.hexdigest()):
            raise SignatureError("the value's signature did not match; it was not unpickled")
        *buffers, body = self._segments
        self._segments, self._views = [], []
        return pickle.loads(body, buffers=buffers)


#: Where a ``bytes`` object's characters start (CPython: after its header; the +1 of
#: ``__basicsize__`` is the terminating NUL).
_BYTES_DATA = bytes.__basicsize__ - 1


def _fresh_bytes(size: int) -> bytes:
    """A new ``bytes`` of ``size`` bytes whose contents are written later, through
    :func:`_writable`: how a pulled ``bytes`` value costs the kernel its size once, not twice
    (a copy out of a buffer). Safe because nothing else holds it until it is complete (a
    ``Receiver`` keeps it to itself until the value is unpickled), and its hash is computed
    only when first asked for. Its pages are mapped as they are written, as a map's are."""
    if size < 2:  # CPython shares the empty and one-byte objects
        return bytes(size)
    new = ctypes.pythonapi.PyBytes_FromStringAndSize
    new.restype, new.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)
    made = new(None, size)
    assert type(made) is bytes and len(made) == size
    return made


def _writable(seg: bytearray | mmap.mmap | bytes) -> memoryview:
    """A writable view of a segment (of a ``bytes`` made by :func:`_fresh_bytes` too)."""
    if type(seg) is bytes:
        if len(seg) < 2:
            return memoryview(bytearray(len(seg)))  # nothing to write into a shared object
        return memoryview((ctypes.c_char * len(seg)).from_address(id(seg) + _BYTES_DATA)) \
            .cast("B")
    return memoryview(seg)
