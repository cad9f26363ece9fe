"""Identity that may cross a process: the model fingerprint and the cryptographic keys of the
disk and shared tiers.

In-RAM keys may stay xxh3-128 (fast, and an entry never outlives the process that made it), but
anything persisted or shared is keyed by SHA-256: a shared store is where a crafted collision
would hand one user's KV to another. The fingerprint covers everything that changes a chunk's
KV or the tokens it stands for: the config's semantic fields (never the path it was loaded from),
the dtype, the transformers and torch versions, the weights (the safetensors index and every
weight file's content, hashed once at load, streaming), the tokenizer, the chat template and
the processor's configuration.

Hashing the weights reads every weight file (GBs for a real checkpoint), so a file's digest is
cached in the store (`weight_digests.json`) under its path, size, mtime_ns, ctime_ns and inode:
a restart with unchanged files reads none of them, and a file written or replaced since (any of
those changes; ctime cannot be set back by a tool the way mtime can) is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import transformers

from mmkv.store.disk_tier import atomic_write

log = logging.getLogger("mmkv.store.fingerprint")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_READ = 1 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of a file's content, read in 1 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ):
            h.update(block)
    return h.hexdigest()


def _file_identity(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


class DigestCache:
    """Weight-file digests by resolved path and identity (size, mtime_ns, ctime_ns, inode), in one
    JSON file. `path=None`: no cache (every file is read). An unreadable cache is just empty."""

    def __init__(self, path: Path | None):
        self.path = path
        self.entries: dict[str, dict] = {}
        self.changed = False
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_bytes())
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                log.warning("ignoring an unreadable weight digest cache %s", path)

    def digest(self, file: Path) -> str:
        name = str(file.resolve())
        identity = _file_identity(file.stat())
        entry = self.entries.get(name)
        if isinstance(entry, dict) and entry.get("id") == identity and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        digest = file_digest(file)
        if _file_identity(file.stat()) == identity:  # not written while it was read
            self.entries[name] = {"id": identity, "sha256": digest}
            self.changed = True
        return digest

    def save(self) -> None:
        if self.path is None or not self.changed:
            return
        try:
            atomic_write(self.path, json.dumps(self.entries, sort_keys=True).encode())
        except OSError as exc:
            log.warning("cannot save the weight digest cache %s: %s", self.path, exc.strerror)


def _weights_from_files(model_dir: Path, cache: DigestCache) -> list[tuple[str, str]] | None:
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not files:
        return None
    indexes = [model_dir / n for n in WEIGHT_INDEXES if (model_dir / n).is_file()]
    out = [(p.name, cache.digest(p)) for p in (*indexes, *files)]
    cache.save()
    return out


def _weights_in_memory(model: torch.nn.Module) -> list[tuple[str, str]]:
    """For a model built in memory (tests, tools): its tensors, name by name."""
    out = []
    for name, t in sorted(model.state_dict().items()):
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
        out.append((name, h.hexdigest()))
    return out


def _semantic(node):
    """A config dict without what says where or by what it was saved rather than what it computes:
    private load state (`_name_or_path`, `_commit_hash`, `_attn_implementation_autoset`, ...) and
    the writer's `transformers_version`, at every depth (sub-configs carry them too)."""
    if isinstance(node, dict):
        return {k: _semantic(v) for k, v in node.items() if not str(k).startswith("_") and k != "transformers_version"}
    if isinstance(node, (list, tuple)):
        return [_semantic(v) for v in node]
    return node


def semantic_config(adapter) -> str:
    """The config's semantic fields, the runtime dtype and the library versions that compute the KV."""
    config = json.dumps(_semantic(adapter.config.to_dict()), sort_keys=True, default=str)
    return f"{config}|{adapter.dtype}|transformers {transformers.__version__}|torch {torch.__version__}"


def model_fingerprint(adapter, model_dir: str | Path | None = None, digest_cache: Path | None = None) -> str:
    """SHA-256 over the config's semantic fields, dtype and library versions (semantic_config), weights, tokenizer, chat template and processor config.
    Weights come from `model_dir` (default: the directory the checkpoint was loaded from) when it
    holds weight files, else from the model's tensors in memory. Tokenizer, template and
    processor come from the live objects, so settings changed after loading count too. Weight
    file digests are kept in `digest_cache` (a JSON file; None: every file is read)."""
    h = hashlib.sha256(b"mmkv-fingerprint-v2\x1f")
    h.update(semantic_config(adapter).encode())
    where = Path(model_dir or adapter.config.name_or_path or "")
    weights = _weights_from_files(where, DigestCache(digest_cache)) if str(where) and where.is_dir() else None
    for name, digest in weights or _weights_in_memory(adapter.model):
        h.update(f"\x1fw:{name}={digest}".encode())
    processor, tokenizer = adapter.processor, adapter.tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(b"\x1ftok:" + (backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(f"\x1fadded:{sorted(tokenizer.get_added_vocab().items())}".encode())
    h.update(f"\x1ftemplate:{getattr(processor, 'chat_template', None) or tokenizer.chat_template}".encode())
    h.update(f"\x1fprocessor:{processor.image_processor.to_json_string()}".encode())
    return h.hexdigest()


def content_digest(content: bytes | str) -> str:
    """SHA-256 of an upload's bytes or a text's UTF-8."""
    return hashlib.sha256(content.encode() if isinstance(content, str) else content).hexdigest()


def image_source_digest(source) -> str:
    """SHA-256 of what an image is recomputed from: its encoded bytes, or an RGB image's size and pixels."""
    if isinstance(source, bytes):
        return content_digest(source)
    return content_digest(f"{source.mode}|{source.width}x{source.height}|".encode() + source.tobytes())


def durable_key(kind: str, digest: str, fingerprint: str, grid_settings: str, anchor: str, tenant: str) -> str:
    """The key of a chunk in the disk and shared tiers: SHA-256 of everything that changes its KV
    (kind, content digest, model fingerprint, grid settings, anchor) and the tenant salt. 64 hex."""
    text = "\x1f".join(("mmkv-chunk-v1", kind, digest, fingerprint, grid_settings, anchor, tenant))
    return hashlib.sha256(text.encode()).hexdigest()
