"""A GGUF file's header read in milliseconds: its key-value metadata and tensor table.

``gguf.GGUFReader`` (the ``gguf`` package, ggml's own) builds numpy views for every element of every
array, so the tokenizer's 49k-262k strings take seconds. This walks the same layout with the package's
own types (``GGUFValueType``, ``GGMLQuantizationType``, ``GGML_QUANT_SIZES``) and its limits, reads
scalars, strings and short arrays, and seeks past long arrays, which stay in the file as a
:class:`LazyArray` until asked for. Anything that does not fit the file's length raises
:class:`GGUFHeaderError`. Nothing here imports ``localllm``. On the default model::

    h = read_header("model.gguf")
    h.fields["general.architecture"], len(h.fields["tokenizer.ggml.tokens"]), h.tensors[0].n_bytes
    # ('llama', 49152, 30081024)
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_VERSION, GGMLQuantizationType
from gguf import GGUFValueType as T

# struct codes of the scalar types (numpy takes the same codes)
_CODE = {T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i", T.FLOAT32: "f",
         T.BOOL: "?", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d"}
EAGER_ARRAY = 1024  # arrays up to this length are read with the header; longer ones on demand
# limits of ggml (ggml.h, src/gguf.cpp), as newer gguf packages' reader mirrors them
MAX_DIMS = 4
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name and its NUL
MAX_STRING = MAX_ARRAY = 1024 * 1024 * 1024


class GGUFHeaderError(ValueError):
    """The header cannot be read: what is wrong, as a clause ("its header runs past the end of the file")."""


@dataclass(frozen=True)
class LazyArray:
    """An array left in the file: element type, length, and the offset of its first element."""

    path: str
    type: T
    count: int
    offset: int
    byteorder: str = "<"

    def __len__(self) -> int:
        return self.count

    def read(self) -> Any:
        """The elements: a numpy array for numbers, a list of strings for strings."""
        if self.type in _CODE:
            import numpy as np

            return np.fromfile(self.path, dtype=np.dtype(self.byteorder + _CODE[self.type]), count=self.count,
                               offset=self.offset)
        with open(self.path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            out, unpack, pos = [], struct.Struct(self.byteorder + "Q").unpack_from, self.offset
            for _ in range(self.count):
                n = unpack(buf, pos)[0]
                out.append(buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"))
                pos += 8 + n
            return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as ggml orders it: the fastest-varying dimension first
    type: GGMLQuantizationType
    offset: int  # of its data, from the start of the file
    n_elements: int
    n_bytes: int


@dataclass
class GGUFHeader:
    version: int
    fields: dict[str, Any]  # key -> int, float, bool, str, list (short arrays) or LazyArray
    tensors: list[TensorInfo]  # empty when read with tensors=False
    data_offset: int  # where the tensor data starts (0 when the tensors were not read)
    file_size: int
    byteorder: str = "<"  # of every number in the file, tensor data included: "<", or ">" (written big-endian)


def read_header(path: str | os.PathLike[str], *, tensors: bool = True) -> GGUFHeader:
    """The header of the GGUF at ``path``; ``tensors=False`` stops after the key-value section."""
    path = os.fspath(path)
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 24:
            raise GGUFHeaderError("its header runs past the end of the file")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != b"GGUF":
                raise GGUFHeaderError("it does not start with the GGUF magic")
            (version,) = struct.unpack_from("<I", buf, 4)
            order = "<" if version & 0xFFFF else ">"  # a file written on a big-endian machine
            (version,) = struct.unpack_from(order + "I", buf, 4)
            if not 2 <= version <= GGUF_VERSION:
                raise GGUFHeaderError(f"it is GGUF version {version}, which cannot be read (2 to {GGUF_VERSION} can)")
            r = _Reader(path, buf, order, 8)
            n_tensors, n_kv = r.u64(), r.u64()
            if n_tensors > MAX_ARRAY or n_kv > MAX_ARRAY:
                raise GGUFHeaderError("its tensor or key count is implausibly large")
            fields: dict[str, Any] = {}
            for key, value in r.items(n_kv):
                if key in fields:
                    raise GGUFHeaderError(f"it has the key {key[:80]!r} twice")
                fields[key] = value
            if not tensors:
                return GGUFHeader(version, fields, [], 0, size, order)
            infos = [r.tensor_info() for _ in range(n_tensors)]
            align = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
            if type(align) is not int or align <= 0 or align & (align - 1):
                raise GGUFHeaderError(f"its general.alignment ({str(align)[:40]}) is not a power of two")
            start = -(-r.pos // align) * align
    seen: set[str] = set()
    out = []
    for name, shape, raw_type, rel in infos:
        if name in seen:
            raise GGUFHeaderError(f"it has the tensor {name!r} twice")
        seen.add(name)
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFHeaderError(f"tensor {name!r} has the unknown type {raw_type}") from None
        n = 1
        for d in shape:
            n *= d
        out.append(TensorInfo(name, shape, qtype, start + rel, n, n * type_size // block))
    return GGUFHeader(version, fields, out, start, size, order)


class _Reader:
    """A cursor over the mapped file; every read checks that it stays inside the file."""

    def __init__(self, path: str, buf: mmap.mmap, order: str, pos: int) -> None:
        self.path, self.buf, self.order, self.pos, self.size = path, buf, order, pos, len(buf)
        self._u32 = struct.Struct(order + "I")
        self._u64 = struct.Struct(order + "Q")

    def _need(self, n: int) -> None:
        if self.pos + n > self.size:
            raise GGUFHeaderError("its header runs past the end of the file")

    def u32(self) -> int:
        self._need(4)
        (v,) = self._u32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(v)

    def u64(self) -> int:
        self._need(8)
        (v,) = self._u64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(v)

    def string(self) -> str:
        n = self.u64()
        if n > MAX_STRING:
            raise GGUFHeaderError("it holds an implausibly long string")
        self._need(n)
        s = self.buf[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _type(self) -> T:
        raw = self.u32()
        try:
            return T(raw)
        except ValueError:
            raise GGUFHeaderError(f"it has a value of unknown type {raw}") from None

    def items(self, n: int) -> Iterator[tuple[str, Any]]:
        for _ in range(n):
            key = self.string()
            yield key, self.value(self._type())

    def value(self, vtype: T) -> Any:
        code = _CODE.get(vtype)
        if code is not None:
            width = struct.calcsize(code)
            self._need(width)
            (v,) = struct.unpack_from(self.order + code, self.buf, self.pos)
            self.pos += width
            return v
        if vtype == T.STRING:
            return self.string()
        if vtype != T.ARRAY:
            raise GGUFHeaderError(f"it has a value of unhandled type {vtype.name}")
        etype, count = self._type(), self.u64()
        if etype == T.ARRAY:
            raise GGUFHeaderError("it has an array of arrays, which ggml does not read")
        if count > MAX_ARRAY:
            raise GGUFHeaderError("it holds an implausibly long array")
        if count <= EAGER_ARRAY:
            return [self.value(etype) for _ in range(count)]
        lazy = LazyArray(self.path, etype, count, self.pos, self.order)
        self._skip(etype, count)
        return lazy

    def _skip(self, etype: T, count: int) -> None:
        code = _CODE.get(etype)
        if code is not None:
            self._need(count * struct.calcsize(code))
            self.pos += count * struct.calcsize(code)
        else:  # strings: each is its u64 length and its bytes, so walk the lengths
            unpack, buf, pos, end = self._u64.unpack_from, self.buf, self.pos, self.size - 8
            for _ in range(count):
                if pos > end:
                    raise GGUFHeaderError("its header runs past the end of the file")
                pos += 8 + unpack(buf, pos)[0]
            self.pos = pos
            self._need(0)

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        if len(name.encode()) >= MAX_NAME:
            raise GGUFHeaderError(f"a tensor name is longer than ggml allows ({MAX_NAME - 1} bytes)")
        n_dims = self.u32()
        if n_dims > MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name!r} has {n_dims} dimensions (ggml allows {MAX_DIMS})")
        shape = tuple(self.u64() for _ in range(n_dims))
        return name, shape, self.u32(), self.u64()
