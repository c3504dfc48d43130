"""The parts of a GGUF the MLX converter reads (:mod:`backends.mlx.convert`): the header from
:mod:`backends.gguf_header` (the vocabulary read only when asked), each tensor's bytes memory-mapped when it is
converted, in the shape ``gguf.GGUFReader`` gives them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.contract.errors import ModelLoadError

if TYPE_CHECKING:
    from backends.gguf_header import TensorInfo


class GGUFFile:
    """The parts of a GGUF the converter reads: the header from :mod:`backends.gguf_header` (the vocabulary
    read only when asked), each tensor's bytes memory-mapped when it is converted."""

    def __init__(self, path: Path):
        from backends.gguf_header import read_header

        try:
            header = read_header(path)
            for t in header.tensors:
                if t.offset + t.n_bytes > header.file_size:
                    raise ValueError(f"tensor {t.name} ends at byte {t.offset + t.n_bytes:,} but the file has "
                                     f"{header.file_size:,} bytes")
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad file
            raise ModelLoadError(f"Cannot read {path.name} as GGUF: {e}") from e
        self.path = path
        self.fields = header.fields
        self.byteorder = header.byteorder
        self.tensors = {t.name: t for t in header.tensors}
        self.arch = str(self.get("general.architecture") or "")

    def get(self, key: str, default: Any = None) -> Any:
        """A field's value; arrays as lists (long ones read from the file on each call)."""
        from backends.gguf_header import LazyArray

        v = self.fields.get(key)
        if v is None:
            return default
        if isinstance(v, LazyArray):
            try:
                v = v.read()
            except Exception:  # noqa: BLE001 - a malformed field reads as missing
                return default
            return v if isinstance(v, list) else v.tolist()
        return v

    def has(self, key: str) -> bool:
        """The field is present and, for an array, not empty (nothing is read)."""
        from backends.gguf_header import LazyArray

        v = self.fields.get(key)
        return len(v) > 0 if isinstance(v, list | LazyArray) else bool(v)

    def a(self, key: str, default: Any = None) -> Any:
        """An architecture-prefixed key: ``a("block_count")`` is ``<arch>.block_count``."""
        return self.get(f"{self.arch}.{key}", default)

    def data(self, t: TensorInfo) -> Any:
        """The tensor's data, memory-mapped (nothing read until used), shaped as ``gguf.GGUFReader`` shapes it:
        numbers for the float and integer types, rows of bytes for the block types."""
        import numpy as np
        from gguf.quants import quant_shape_to_byte_shape

        shape, code = np_shape(t), _NUMPY_TYPES.get(t.type.name)
        if code is None:
            return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset,
                             shape=quant_shape_to_byte_shape(shape, t.type))
        return np.memmap(self.path, dtype=np.dtype(self.byteorder + code), mode="r", offset=t.offset, shape=shape)

    def array(self, name: str) -> Any:
        """A float32 numpy copy of a (small, float) tensor, in GGUF's row-major layout."""
        import numpy as np
        from gguf.quants import dequantize

        t = self.tensors[name]
        return np.asarray(dequantize(self.data(t), t.type), dtype=np.float32).reshape(np_shape(t))


# GGML types whose data is numbers, as numpy type codes (the byte order goes before); the rest are blocks of bytes
_NUMPY_TYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


def np_shape(t: TensorInfo) -> tuple[int, ...]:
    return tuple(int(x) for x in reversed(t.shape))
