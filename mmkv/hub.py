"""Where a model name points: a local checkpoint directory, or a hub id ("Qwen/Qwen2.5-VL-7B-Instruct")
found in the local Hugging Face hub cache, offline, as transformers resolves it with
local_files_only: <cache>/models--Qwen--Qwen2.5-VL-7B-Instruct/refs/main names the snapshot.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from mmkv.errors import ModelLoadError

# owner/name[@revision], as the hub spells repo ids (no path separators inside either part).
HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<rev>[\w.-]+))?$")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # the checkpoint directory to load
    model_id: str  # what /v1/models reports: the hub id, or the directory's name


def hub_cache_dir() -> Path:
    """The hub cache transformers would use, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def resolve_model(name: str | Path) -> ResolvedModel:
    """An existing directory is used as it is; otherwise `name` must be a hub id present in the
    local hub cache. ModelLoadError says where it looked."""
    path = Path(name).expanduser()
    if path.is_dir():
        return ResolvedModel(path, path.name)
    text = str(name)
    match = HUB_ID.match(text)
    if match is None or text.startswith((".", "/", "~")):
        raise ModelLoadError(f"model directory {text!r} does not exist or is not a directory")
    repo, revision = match["repo"], match["rev"] or "main"
    cache = hub_cache_dir()
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        have = sorted(p.name for p in (repo_dir / "snapshots").glob("*")) if repo_dir.is_dir() else []
        detail = f"; snapshots there: {', '.join(have)}" if have else ""
        raise ModelLoadError(
            f"{text!r} is neither a local directory nor in the Hugging Face hub cache: looked for "
            f"{snapshot} (cache {cache}, from HF_HUB_CACHE / HF_HOME / ~/.cache/huggingface/hub){detail}. "
            f"Download it first (huggingface-cli download {repo}) or pass a checkpoint directory")
    return ResolvedModel(snapshot, repo if revision == "main" else text)
