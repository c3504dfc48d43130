"""An MLX sequence's KV caches as bytes, for the prompt cache on disk (:meth:`backends.mlx.source.MLXSource.state_save`
and ``state_load``): a length-prefixed JSON header (per layer: the quantization, and dtype and shape of each
array) and then the arrays' raw bytes, cut to the positions the sequence holds. Loading checks every array
against the model's shape before it makes a cache."""

from __future__ import annotations

from typing import Any

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}  # a dtype's bits as raw integers, by item size
KV_DTYPES = ("float16", "bfloat16", "float32", "uint32")  # what a saved KV array may be (uint32: packed quants)


def kv_cache(keys: Any, values: Any, offset: int, quant: tuple[int, int] | None) -> Any:
    """An mlx-lm cache holding ``keys``/``values`` (arrays, or (w, scales, biases) tuples when ``quant`` is
    (group size, bits)) at ``offset`` positions."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    c = KVCache() if quant is None else QuantizedKVCache(group_size=quant[0], bits=quant[1])
    c.keys, c.values, c.offset = keys, values, offset
    return c


def caches_to_bytes(cache: list[Any]) -> bytes:
    """One sequence's per-layer caches (plain or quantized ``KVCache``) as bytes."""
    import json

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import QuantizedKVCache

    n = cache[0].offset
    layers: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for c in cache:
        quant = isinstance(c, QuantizedKVCache)
        parts = [*c.keys, *c.values] if quant else [c.keys, c.values]
        arrays = []
        for a in parts:
            a = a[..., :n, :]
            raw = np.array(a.view(getattr(mx, _UINT[a.dtype.size]))).tobytes()
            arrays.append({"dtype": str(a.dtype).removeprefix("mlx.core."), "shape": list(a.shape)})
            blobs.append(raw)
        layers.append({"quant": [c.group_size, c.bits] if quant else None, "arrays": arrays})
    head = json.dumps({"format": 1, "offset": n, "layers": layers}).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def caches_from_bytes(data: bytes, *, n_layers: int, heads: int, quant: tuple[int, int] | None) -> list[Any] | None:
    """:func:`caches_to_bytes`'s bytes as caches (evaluated), or None for bytes that do not fit a model of
    ``n_layers`` layers, ``heads`` KV heads and this KV quantization (group size, bits), or a dtype not saved."""
    import json

    import mlx.core as mx
    import numpy as np

    want = list(quant) if quant is not None else None
    try:
        size = int.from_bytes(data[:8], "little")
        head = json.loads(data[8:8 + size])
        n, layers = int(head["offset"]), head["layers"]
        if head.get("format") != 1 or n <= 0 or len(layers) != n_layers:
            return None
        pos, new = 8 + size, []
        for layer in layers:
            if layer["quant"] != want or len(layer["arrays"]) != (6 if quant else 2):
                return None
            arrays = []
            for a in layer["arrays"]:
                if a["dtype"] not in KV_DTYPES:
                    return None
                dtype, shape = getattr(mx, a["dtype"]), tuple(a["shape"])
                if len(shape) != 4 or shape[:3] != (1, heads, n):
                    return None
                count = int(np.prod(shape)) * dtype.size
                if pos + count > len(data):
                    return None
                raw = np.frombuffer(data, dtype=f"<u{dtype.size}", count=count // dtype.size, offset=pos)
                arrays.append(mx.array(raw.reshape(shape)).view(dtype))
                pos += count
            if quant:
                new.append(kv_cache(tuple(arrays[:3]), tuple(arrays[3:]), n, quant))
            else:
                new.append(kv_cache(arrays[0], arrays[1], n, None))
        if pos != len(data):
            return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    mx.eval([x.state for x in new])
    return new
