"""A split GGUF (``NAME-00001-of-0000N.gguf``, how the Hub holds gpt-oss 120B) read by its first part: every part's
tensors count (parameters, sizes for the planner), a missing part is refused in one sentence."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm.errors import InvalidModelFileError
from localllm.ggufinfo import read_gguf


def write_split(src: Path, dst_dir: Path, max_tensors: int = 150) -> list[Path]:
    """``src`` rewritten as split files of at most ``max_tensors`` tensors (gguf's own split writer)."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    w = gguf.GGUFWriter(dst_dir / "smol.gguf", arch=arch, endianess=reader.endianess, split_max_tensors=max_tensors)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        w.data_alignment = alignment.contents()
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in reader.tensors:
        w.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    w.close()
    return sorted(dst_dir.glob("smol-*-of-*.gguf"))


def test_a_split_gguf_counts_all_its_parts(default_model_path, tmp_path):
    parts = write_split(Path(default_model_path), tmp_path)
    assert [p.name for p in parts] == ["smol-00001-of-00002.gguf", "smol-00002-of-00002.gguf"]
    whole, first = read_gguf(default_model_path), read_gguf(parts[0])
    assert first.parameters == whole.parameters and first.n_layers == whole.n_layers
    assert first.file_size == sum(p.stat().st_size for p in parts)
    assert sum(first.extra["tensor_bytes"]["layers"]) == sum(whole.extra["tensor_bytes"]["layers"])
    parts[1].unlink()
    with pytest.raises(InvalidModelFileError, match=r"^smol-00001-of-00002.gguf is part 1 of 2; "
                                                    r"smol-00002-of-00002.gguf is missing beside it.$"):
        read_gguf(parts[0])
