"""Records that outlive the process: uploaded images and videos (the engine's `image` and `video`
records, the server's `file` record) and skills, per tenant, with their content-addressed blobs,
on disk and / or in the shared tier (Redis or Mooncake Store: mmkv/store/shared_tier.py has its
key layout).

Disk layout under the store root: `records/<kind>/<sha256(tenant)[:32]>/<id>.json` (the record
with a SHA-256 of itself) and `blobs/<sha256[:2]>/<sha256>` (an upload's original bytes, or a
video's sampled frames, kept while any record names it). A blob is written before the record
that names it, and a record is removed before its blob, so a crash leaves at worst an unnamed
blob, removed at the next start.
A record or blob that fails its checksum is removed and counted, never used.

Thread-safe: one lock around every operation.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from mmkv.store.disk_tier import atomic_write, fsync_dir, remove_temporaries
from mmkv.store.fingerprint import content_digest
from mmkv.store.shared_tier import SharedTier

log = logging.getLogger("mmkv.store.durable_registry")
KINDS = ("image", "video", "file", "skill")
ID_PATTERN = re.compile(r"[a-z]+-[0-9a-f]{32}")  # engine ids: img-<hash>, vid-<hash>, skill-<hash>


@dataclass(frozen=True)
class Record:
    kind: str
    tenant: str
    id: str
    meta: dict
    blob: bytes | None = None


def _tenant_dir(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


def _seal(body: dict) -> bytes:
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "sum": content_digest(text)}, sort_keys=True).encode()


def _unseal(data: bytes) -> dict | None:
    try:
        doc = json.loads(data)
        body = doc["body"]
        return body if content_digest(json.dumps(body, sort_keys=True)) == doc["sum"] else None
    except (ValueError, KeyError, TypeError):
        return None


class DurableRegistry:
    def __init__(self, root: Path | None, shared: SharedTier | None):
        self.root, self.shared = (Path(root) if root is not None else None), shared
        self._lock = threading.Lock()
        self.corrupt = 0
        self._refs: dict[str, set[tuple[str, str, str]]] = {}  # blob digest -> records naming it (disk)
        if self.root is not None:
            self._open_disk()

    # ---- disk ------------------------------------------------------------------------------------
    def _open_disk(self) -> None:
        remove_temporaries(self.root)
        for rec_path, body in self._scan():
            if body is None:
                rec_path.unlink(missing_ok=True)
                self.corrupt += 1
            elif body.get("blob"):
                self._refs.setdefault(body["blob"], set()).add((body["kind"], body["tenant"], body["id"]))
        for blob in (self.root / "blobs").glob("*/*"):
            if blob.name not in self._refs:
                blob.unlink(missing_ok=True)  # written just before a crash, never named

    def _scan(self, kind: str | None = None):
        base = self.root / "records"
        for path in sorted(base.glob(f"{kind or '*'}/*/*.json")):
            try:
                yield path, _unseal(path.read_bytes())
            except OSError:
                continue

    def _record_path(self, kind: str, tenant: str, id_: str) -> Path:
        return self.root / "records" / kind / _tenant_dir(tenant) / f"{id_}.json"

    def _blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / digest[:2] / digest

    def _read_blob(self, digest: str) -> bytes | None:
        try:
            data = self._blob_path(digest).read_bytes()
        except OSError:
            return None
        if content_digest(data) != digest:
            self._blob_path(digest).unlink(missing_ok=True)
            self.corrupt += 1
            return None
        return data

    # ---- the interface ---------------------------------------------------------------------------
    def put(self, kind: str, tenant: str, id_: str, meta: dict, blob: bytes | None = None) -> None:
        """Persist a record (and its blob first) in every tier configured."""
        digest = content_digest(blob) if blob is not None else None
        body = {"kind": kind, "tenant": tenant, "id": id_, "meta": meta, "blob": digest}
        with self._lock:
            if self.root is not None:
                if digest is not None and not self._blob_path(digest).exists():
                    atomic_write(self._blob_path(digest), blob)
                atomic_write(self._record_path(kind, tenant, id_), _seal(body))
                if digest is not None:
                    self._refs.setdefault(digest, set()).add((kind, tenant, id_))
        if self.shared is not None:
            self.shared.record_put(kind, tenant, id_, _seal(body), digest, blob)

    def get(self, kind: str, tenant: str, id_: str) -> Record | None:
        """The record with its blob: from disk, else from the shared tier (then kept on disk)."""
        if not ID_PATTERN.fullmatch(id_ or ""):
            return None
        with self._lock:
            if self.root is not None:
                found = self._get_disk(kind, tenant, id_)
                if found is not None:
                    return found
        found = self._get_shared(kind, tenant, id_)
        if found is not None and self.root is not None:
            with self._lock:
                self._put_disk_only(found)
        return found

    def _get_disk(self, kind: str, tenant: str, id_: str) -> Record | None:
        path = self._record_path(kind, tenant, id_)
        try:
            body = _unseal(path.read_bytes())
        except OSError:
            return None
        if body is None:
            path.unlink(missing_ok=True)
            self.corrupt += 1
            return None
        blob = self._read_blob(body["blob"]) if body["blob"] else None
        if body["blob"] and blob is None:
            return None
        return Record(kind, tenant, id_, body["meta"], blob)

    def _put_disk_only(self, rec: Record) -> None:
        digest = content_digest(rec.blob) if rec.blob is not None else None
        if digest is not None:
            atomic_write(self._blob_path(digest), rec.blob)
            self._refs.setdefault(digest, set()).add((rec.kind, rec.tenant, rec.id))
        atomic_write(self._record_path(rec.kind, rec.tenant, rec.id),
                     _seal({"kind": rec.kind, "tenant": rec.tenant, "id": rec.id, "meta": rec.meta, "blob": digest}))

    def _get_shared(self, kind: str, tenant: str, id_: str) -> Record | None:
        s = self.shared
        if s is None:
            return None
        raw = s.record_get(kind, tenant, id_)
        if raw is None:
            return None
        body = _unseal(raw)
        if body is None or body.get("id") != id_ or body.get("tenant") != tenant:
            s.record_drop(kind, tenant, id_)
            self.corrupt += 1
            return None
        blob = None
        if body["blob"]:
            blob = s.blob_get(kind, tenant, id_, body["blob"])
            if blob is None or content_digest(blob) != body["blob"]:
                if blob is not None:
                    self.corrupt += 1
                return None
        return Record(kind, tenant, id_, body["meta"], blob)

    def remove(self, kind: str, tenant: str, id_: str) -> None:
        """Drop the record everywhere, and its blob where no other record names it: the shared tier
        first (a tombstone, so every server drops its copy), and only once it answered the disk, so
        a delete the shared tier did not take (SharedTierUnavailableError) changes nothing here
        and cannot be undone by a later read from it."""
        if self.shared is not None:
            self.shared.record_remove(kind, tenant, id_, lambda raw: (_unseal(raw) or {}).get("blob"))
        self.drop_local(kind, tenant, id_)

    def drop_local(self, kind: str, tenant: str, id_: str) -> None:
        """Drop the disk's copy of a record (one deleted on another server: the shared tier has its tombstone)."""
        with self._lock:
            if self.root is not None:
                path = self._record_path(kind, tenant, id_)
                body = _unseal(path.read_bytes()) if path.exists() else None
                path.unlink(missing_ok=True)
                if path.parent.exists():
                    fsync_dir(path.parent)
                digest = body.get("blob") if body else None
                users = self._refs.get(digest)
                if users is not None:
                    users.discard((kind, tenant, id_))
                    if not users:
                        del self._refs[digest]
                        self._blob_path(digest).unlink(missing_ok=True)

    def gone(self, kind: str, tenant: str, id_: str) -> bool:
        """True when the shared tier says this record was deleted, on any server (False without it,
        or while it does not answer: a server that cannot ask keeps serving what it has)."""
        return self.shared is not None and self.shared.gone(kind, tenant, id_)

    def local(self, kind: str) -> list[Record]:
        """Every record of `kind` on disk, with its blob: what a restarted server serves again."""
        if self.root is None:
            return []
        with self._lock:
            out = []
            for path, body in self._scan(kind):
                if body is None:
                    path.unlink(missing_ok=True)
                    self.corrupt += 1
                    continue
                rec = self._get_disk(kind, body["tenant"], body["id"])
                if rec is not None:
                    out.append(rec)
            return out

    def shared_ids(self, kind: str, tenant: str) -> list[str]:
        """Ids of `kind` the shared tier holds for `tenant` (records only; [] without it or when down)."""
        return self.shared.record_ids(kind, tenant) if self.shared is not None else []
