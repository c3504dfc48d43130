"""``verify``: every file an installed name uses (its weights, projector and adapters) hashed again against the digest
its manifest records, so a file damaged after it was installed (a crash before its bytes reached the disk, a bad
sector, an edit in place) is named instead of loaded."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localllm.errors import InvalidNameError
from localllm.names import parse_name
from localllm.store.create import Creating


@dataclass(frozen=True)
class FileCheck:
    """One file of an installed model, as :meth:`Verifying.verify` found it."""

    model: str
    part: str  # "weights", "projector" or "adapter"
    path: Path
    digest: str  # what the manifest records: sha256:<hex>
    size: int  # bytes on disk (-1: missing)
    problem: str = ""  # "": intact; "missing", "incomplete", "corrupt"
    fix: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem

    def sentence(self) -> str:
        """What is wrong with it and what to do, in one sentence."""
        what = f"{self.model}: its {self.part} file {self.path}"
        if self.problem == "corrupt":
            return f"{what} is corrupt: its bytes no longer hash to {self.digest[:19]}...; {self.fix}."
        if self.problem == "incomplete":
            return f"{what} is incomplete ({self.size:,} bytes on disk); {self.fix}."
        return f"{what} is {self.problem}; {self.fix}."


class Verifying(Creating):
    """``verify`` (``localllm verify``)."""

    def installed_names(self) -> list[str]:
        """Every installed name, those whose files are missing or incomplete included (``list`` leaves them out)."""
        names = []
        for p in self._manifest_files():
            try:
                names.append(str(json.loads(p.read_text(encoding="utf-8"))["name"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return sorted(names)

    def verify(self, name: str, *, hashed: dict[Path, str] | None = None,
               on_bytes: Callable[[int], None] | None = None) -> list[FileCheck]:
        """Each file installed ``name`` uses, hashed again (a file already in ``hashed``, a memo of path -> hex
        digest shared across calls, is not read twice). Raises :class:`~localllm.errors.ModelNotFoundError` for a
        name that is not installed, :class:`~localllm.errors.InvalidNameError` for a path (nothing recorded)."""
        from localllm.download import sha256_file

        ref = parse_name(name, allow_path=True)
        if ref.kind == "path":
            raise InvalidNameError(f"{name} is a file used in place: no digest is recorded for it to verify.")
        found = self._find(ref)
        if found is None:
            raise self._not_installed(ref)
        data: dict[str, Any] = json.loads(self._manifest_path(found[0]).read_text(encoding="utf-8"))
        model = str(data.get("name") or found[0].name)
        # what fetches the file again: the catalog name it came from (a copy or a created model shares that blob), a
        # Hub name itself; else the Modelfile it was created from
        source = data.get("catalog") or (model if model.startswith("hf.co/") else None)
        fetch = f"run `localllm pull {source}` to fetch it again" if source else "create it again"
        parts: list[tuple[str, Path, str, int]] = []  # (part, path, digest, recorded size: -1 unknown)

        def add(part: str, d: dict[str, Any]) -> None:
            path = Path(d["path"]) if d.get("external") else self.blob_path(str(d["digest"]))
            parts.append((part, path, str(d["digest"]), int(d.get("size", -1))))

        fixes = {"weights": fetch, "projector": fetch, "adapter": "create it again"}

        add("weights", data)
        if data.get("projector"):
            add("projector", data["projector"])
        for a in (data.get("derived") or {}).get("adapters") or []:
            add("adapter", {"digest": str(a).split()[0]})
        memo = hashed if hashed is not None else {}
        out = []
        for part, path, digest, size in parts:
            fix = fixes[part]
            try:
                have = path.stat().st_size
            except OSError:
                out.append(FileCheck(model, part, path, digest, -1, "missing", fix))
                continue
            if size >= 0 and have != size:
                out.append(FileCheck(model, part, path, digest, have, "incomplete", fix))
                continue
            if path not in memo:
                try:
                    memo[path] = sha256_file(path, on_bytes)
                except OSError:
                    memo[path] = ""
            ok = memo[path] == digest.removeprefix("sha256:").lower()
            out.append(FileCheck(model, part, path, digest, have, "" if ok else "corrupt", fix))
        return out
