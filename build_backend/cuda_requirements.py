"""The CUDA plugin's runtime libraries (pip's nvidia-cublas and nvidia-nccl-cu13, ~0.7 GB) are dependencies of a wheel
that holds the plugin, and of no other: a build without it drops their Requires-Dist lines from the metadata it
writes (the prepared metadata pip resolves from, and the wheel's own, with its RECORD entry). No scikit-build-core
import here, so the tests can load it alone."""
from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import tempfile
import zipfile

CUDA_RUNTIME_PACKAGES = ("nvidia-cublas", "nvidia-nccl-cu13")


def _requires(line: str) -> str | None:
    """The distribution a Requires-Dist line names (normalized), or None for other lines."""
    m = re.match(r"Requires-Dist:\s*([A-Za-z0-9._-]+)", line)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else None


def drop_cuda_requirements(metadata: str) -> str:
    """METADATA text without the Requires-Dist lines of CUDA_RUNTIME_PACKAGES."""
    lines = metadata.splitlines(keepends=True)
    return "".join(line for line in lines if _requires(line) not in CUDA_RUNTIME_PACKAGES)


def drop_in_dist_info(dist_info: str) -> None:
    """Rewrites <dist_info>/METADATA in place (prepare_metadata_for_build_*)."""
    path = os.path.join(dist_info, "METADATA")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(drop_cuda_requirements(text))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def drop_in_wheel(wheel: str) -> None:
    """Rewrites the wheel's *.dist-info/METADATA and its RECORD line (hash and size); other entries are copied."""
    with zipfile.ZipFile(wheel) as src:
        infos = src.infolist()
        data = {i.filename: src.read(i.filename) for i in infos}
    meta = next(n for n in data if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
    record = meta[: -len("METADATA")] + "RECORD"
    new_meta = drop_cuda_requirements(data[meta].decode("utf-8")).encode("utf-8")
    if new_meta == data[meta]:
        return
    data[meta] = new_meta
    rows = data[record].decode("utf-8").splitlines()
    for i, row in enumerate(rows):
        if row.split(",", 1)[0] == meta:
            rows[i] = f"{meta},{_record_hash(new_meta)},{len(new_meta)}"
    data[record] = ("\n".join(rows) + "\n").encode("utf-8")
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(wheel) or ".")
    os.close(fd)
    with zipfile.ZipFile(tmp, "w") as dst:
        for info in infos:
            dst.writestr(info, data[info.filename])
    shutil.move(tmp, wheel)
