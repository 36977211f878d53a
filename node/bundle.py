"""Model directories as one file for SHARDCAST: safetensors, JSON config and tokenizer only, checked both ways.

A bundle is b"SHOALMD1", an 8-byte little-endian header length, a JSON header
``{"files": [{"name", "size", "sha256"}, ...]}`` and the files' bytes in header order. Nothing in
a bundle is ever executed: names are checked against an allowlist before anything is written,
pickled weights (``*.bin``, ``*.pt``, ...) and Python files are refused with the reason, and a
config that asks for remote code (``auto_map``) is refused, so ``trust_remote_code`` is never needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from node.fsutil import write_atomic
from protocol.errors import ConfigError

MAGIC = b"SHOALMD1"
MAX_HEADER_BYTES = 1 << 20
MAX_FILES = 256
ALLOWED_NAMES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
    r"|model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json|README\.md)$")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib", ".npy", ".npz", ".h5", ".msgpack")
CODE_SUFFIXES = (".py", ".pyc", ".so", ".sh")
REQUIRED = ("config.json", "tokenizer.json")
SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ModelRefused(ConfigError):
    """A model directory or bundle that Shoal will not load; str() says why and what to do."""


@dataclass(frozen=True, kw_only=True)
class ModelInfo:
    """What the files say about a model, read without torch: enough to judge it before loading."""

    architecture: str
    model_type: str
    vocab_size: int
    tokenizer_vocab: int
    num_params: int
    weight_bytes: int


def _refuse_name(name: str) -> None:
    lower = name.lower()
    if lower.endswith(PICKLE_SUFFIXES):
        raise ModelRefused(f"the model directory holds {name}, a pickle-based file; Shoal loads only "
                           "safetensors weights (save with safe_serialization=True)")
    if lower.endswith(CODE_SUFFIXES):
        raise ModelRefused(f"the model directory holds {name}, code; nothing from the network is executed, "
                           "so only built-in transformers architectures are accepted")
    if not ALLOWED_NAMES.match(name):
        raise ModelRefused(f"the model directory holds {name!r}, which is not a config, tokenizer or "
                           "safetensors file; remove it")


def _safetensors_params(data: bytes, name: str) -> tuple[int, int]:
    """(values, bytes) of the tensors in a safetensors file, from its header alone."""
    if len(data) < 8:
        raise ModelRefused(f"{name} is not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(len(data) - 8, 100 << 20):
        raise ModelRefused(f"{name} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError:
        raise ModelRefused(f"{name} is not a safetensors file (header is not JSON)") from None
    values = nbytes = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_BYTES:
            raise ModelRefused(f"{name}: tensor {key!r} has an unsupported dtype")
        n = 1
        for d in entry.get("shape", []):
            n *= int(d)
        values += n
        nbytes += n * SAFETENSORS_BYTES[entry["dtype"]]
    return values, nbytes


def _tokenizer_vocab(tokenizer: dict) -> int:
    """The largest token id + 1 that tokenizer.json can produce (its model's vocab and added tokens)."""
    ids = [int(t["id"]) for t in tokenizer.get("added_tokens") or [] if isinstance(t, dict) and "id" in t]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        ids += [int(v) for v in vocab.values()]
    elif isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    return max(ids) + 1 if ids else 0


def check_files(files: dict[str, bytes]) -> ModelInfo:
    """ModelRefused unless these files are a model transformers builds without remote code or pickle."""
    if len(files) > MAX_FILES:
        raise ModelRefused(f"a model directory has at most {MAX_FILES} files, this one {len(files)}")
    for name in files:
        _refuse_name(name)
    for name in REQUIRED:
        if name not in files:
            raise ModelRefused(f"the model directory has no {name} (save the model and its fast tokenizer "
                               "with save_pretrained)")
    weights = [n for n in files if n.endswith(".safetensors")]
    if not weights:
        raise ModelRefused("the model directory has no safetensors weights (model.safetensors)")
    try:
        config = json.loads(files["config.json"])
        tokenizer = json.loads(files["tokenizer.json"])
        tok_config = json.loads(files.get("tokenizer_config.json", b"{}"))
    except ValueError as exc:
        raise ModelRefused(f"a JSON file of the model directory does not parse: {exc}") from None
    for what, table in (("config.json", config), ("tokenizer_config.json", tok_config)):
        if not isinstance(table, dict):
            raise ModelRefused(f"{what} must be a JSON object")
        if "auto_map" in table or table.get("trust_remote_code"):
            raise ModelRefused(f"{what} asks for remote code (auto_map); Shoal never runs code from a model "
                               "directory: use a built-in transformers architecture")
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ModelRefused("config.json has no vocab_size")
    tokenizer_vocab = _tokenizer_vocab(tokenizer if isinstance(tokenizer, dict) else {})
    if tokenizer_vocab > vocab_size:
        raise ModelRefused(f"the tokenizer does not match the model: it makes token ids up to {tokenizer_vocab - 1}, "
                           f"the model's embedding has {vocab_size} rows")
    values = nbytes = 0
    for name in weights:
        v, b = _safetensors_params(files[name], name)
        values, nbytes = values + v, nbytes + b
    archs = config.get("architectures") or [""]
    return ModelInfo(architecture=str(archs[0]), model_type=str(config.get("model_type", "")),
                     vocab_size=vocab_size, tokenizer_vocab=tokenizer_vocab, num_params=values, weight_bytes=nbytes)


def read_dir(directory: str | os.PathLike) -> dict[str, bytes]:
    directory = Path(directory)
    if not directory.is_dir():
        raise ModelRefused(f"{directory} is not a directory")
    out = {}
    for path in sorted(directory.iterdir()):
        if path.is_dir():
            raise ModelRefused(f"the model directory holds a subdirectory {path.name}/; Shoal takes a flat "
                               "directory as save_pretrained writes it")
        out[path.name] = path.read_bytes()
    return out


def pack(directory: str | os.PathLike, out: str | os.PathLike) -> ModelInfo:
    """Check a model directory and write it as one bundle file."""
    files = read_dir(directory)
    info = check_files(files)
    entries = [{"name": n, "size": len(files[n]), "sha256": hashlib.sha256(files[n]).hexdigest()} for n in sorted(files)]
    header = json.dumps({"files": entries}, sort_keys=True, separators=(",", ":")).encode()
    with open(out, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for name in sorted(files):
            f.write(files[name])
    return info


def parse(data: bytes) -> dict[str, bytes]:
    """The files of a bundle; ModelRefused if it is malformed or any file fails its hash."""
    if data[:8] != MAGIC or len(data) < 16:
        raise ModelRefused("not a Shoal model bundle (publish the directory with `shoal model publish DIR`)")
    (size,) = struct.unpack("<Q", data[8:16])
    if size > MAX_HEADER_BYTES or 16 + size > len(data):
        raise ModelRefused("model bundle header is too large or cut short")
    try:
        entries = json.loads(data[16:16 + size])["files"]
    except (ValueError, KeyError, TypeError):
        raise ModelRefused("model bundle header is not valid") from None
    files, offset = {}, 16 + size
    for e in entries:
        name, n = str(e["name"]), int(e["size"])
        _refuse_name(name)
        blob = data[offset:offset + n]
        if len(blob) != n or hashlib.sha256(blob).hexdigest() != e["sha256"]:
            raise ModelRefused(f"model bundle file {name} is cut short or does not match its hash")
        files[name] = blob
        offset += n
    if offset != len(data):
        raise ModelRefused("model bundle has trailing bytes")
    return files


def unpack(bundle_path: str | os.PathLike, directory: str | os.PathLike) -> ModelInfo:
    """Check a bundle and write its files into directory (created); nothing is written if a check fails."""
    files = parse(Path(bundle_path).read_bytes())
    info = check_files(files)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, blob in files.items():
        write_atomic(directory / name, blob)
    return info
