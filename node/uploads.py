"""Files handed to the node through the control API in JSON chunks (`shoal shard publish`), both ends.

The node never reads a path a caller names, except under the operator's ``publish_dir``: the CLI
sends the file's bytes instead, so the control API cannot be used to publish the node's own files.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from node.control import ControlClient, HttpError

CHUNK_BYTES = 4 * 2**20
"""Raw bytes per upload request; base64 in JSON makes it about 5.6 MB, under the control API's body cap."""
MAX_UPLOADS = 4
IDLE_S = 600.0
"""An upload with no chunk for this long is dropped when the next one begins."""


@dataclass
class Upload:
    upload_id: str
    name: str
    total_bytes: int
    path: Path
    received: int = 0
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)
    touched_at: float = field(default_factory=time.monotonic)


def _clean_name(name: object) -> str:
    base = os.path.basename(str(name or "upload")).strip() or "upload"
    return base[:200]


class Uploads:
    """The node's side: begin, append chunks in order, finish with the whole file's sha256."""

    def __init__(self, directory: Path, *, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.part"):  # a restart forgets its uploads; their files go too
            stale.unlink(missing_ok=True)
        self.open: dict[str, Upload] = {}

    def begin(self, name: object, total_bytes: object) -> Upload:
        if not isinstance(total_bytes, int) or isinstance(total_bytes, bool) or not 0 <= total_bytes <= self.max_bytes:
            raise HttpError(400, f"bytes must be a size between 0 and {self.max_bytes}")
        now = time.monotonic()
        for upload in [u for u in self.open.values() if now - u.touched_at > IDLE_S]:
            self.discard(upload.upload_id)
        if len(self.open) >= MAX_UPLOADS:
            raise HttpError(409, f"{MAX_UPLOADS} uploads are already open; finish one first")
        upload_id = secrets.token_hex(16)
        upload = Upload(upload_id, _clean_name(name), total_bytes, self.directory / f"{upload_id}.part")
        upload.path.write_bytes(b"")
        self.open[upload_id] = upload
        return upload

    def get(self, upload_id: object) -> Upload:
        upload = self.open.get(str(upload_id))
        if upload is None:
            raise HttpError(404, "no open upload with that id; begin one with POST /shard/upload {name, bytes}")
        return upload

    def append(self, upload: Upload, offset: object, data_b64: object) -> None:
        """Blocking (file I/O): call from a worker thread."""
        if offset != upload.received:
            raise HttpError(409, f"expected the chunk at offset {upload.received}, got {offset}")
        try:
            data = base64.b64decode(str(data_b64), validate=True)
        except ValueError:
            raise HttpError(400, "data must be base64") from None
        if upload.received + len(data) > upload.total_bytes:
            raise HttpError(400, f"more bytes than the {upload.total_bytes} announced")
        with open(upload.path, "ab") as f:
            f.write(data)
        upload.digest.update(data)
        upload.received += len(data)
        upload.touched_at = time.monotonic()

    def finish(self, upload: Upload, sha256_hex: object) -> Upload:
        if upload.received != upload.total_bytes:
            raise HttpError(409, f"upload incomplete: {upload.received} of {upload.total_bytes} bytes")
        if str(sha256_hex).lower() != upload.digest.hexdigest():
            self.discard(upload.upload_id)
            raise HttpError(400, "the uploaded bytes do not match the sha256 given; upload again")
        return upload

    def discard(self, upload_id: str) -> None:
        upload = self.open.pop(upload_id, None)
        if upload is not None:
            upload.path.unlink(missing_ok=True)


def allowed_path(text: object, *, publish_dir: str, data_dir: Path) -> Path:
    """The file ``text`` names, if it lies under ``publish_dir`` and outside the data dir; else HttpError 403."""
    if not publish_dir:
        raise HttpError(403, "this node reads no files for the control API (publish_dir is unset): "
                             "`shoal shard publish` uploads the file's content instead")
    try:
        path = Path(str(text)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise HttpError(400, f"{text} is not an existing file") from None
    allowed = Path(publish_dir).expanduser().resolve()
    if not path.is_relative_to(allowed) or path.is_relative_to(data_dir.resolve()):
        raise HttpError(403, f"{text} is not under publish_dir ({allowed}) or lies in the data dir")
    if not path.is_file():
        raise HttpError(400, f"{text} is not a regular file")
    return path


def upload_and_publish(client: ControlClient, path: Path, *, timeout_s: float = 600.0,
                       progress: Callable[[int, int], None] | None = None) -> dict:
    """The CLI's side: send ``path``'s bytes in chunks, then ask the node to publish them; the node's answer."""
    total = path.stat().st_size
    upload = client.call("/shard/upload", body={"name": path.name, "bytes": total})
    digest = hashlib.sha256()
    offset = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            client.call("/shard/upload", body={"upload_id": upload["upload_id"], "offset": offset,
                                               "data": base64.b64encode(chunk).decode()}, timeout_s=timeout_s)
            offset += len(chunk)
            if progress is not None:
                progress(offset, total)
    return client.call("/shard/publish", body={"upload_id": upload["upload_id"], "sha256": digest.hexdigest()},
                       timeout_s=timeout_s)
