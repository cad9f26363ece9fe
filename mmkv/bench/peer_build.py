"""The peer `mmkv bench-peers` runs beside mmkv: llama.cpp's `llama-server`, built here from the
llama-cpp-python source distribution on PyPI (it vendors llama.cpp: the server, `convert_hf_to_gguf.py`
and the multimodal projectors), and the checkpoint both serve: a random Qwen-VL of the bench size with
Qwen's real tokenizer, saved as a Hugging Face checkpoint and converted to GGUF by llama.cpp's own
converter (text model, then `--mmproj`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-python"
# CPU only, Release, one static binary; no tests, examples, web UI or HTTPS (nothing is fetched at
# build time); -march=native as llama.cpp builds by default.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_UI=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF")
TARGETS = ("llama-server",)
DEFAULT_PEER_DIR = Path(os.environ.get("MMKV_PEER_DIR", "~/.cache/mmkv/peer")).expanduser()

# The bench checkpoint: `mmkv bench --config bench`'s LM and vision tower (mmkv.bench.run) on
# Qwen2.5-VL's released layout and tokenizer, embeddings tied as Qwen2.5-VL-3B ties them (the
# 152k-row table dominates the weights).
BENCH_TEXT = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=32768)
BENCH_VISION = dict(depth=8, hidden_size=640, intermediate_size=1536, num_heads=10, out_hidden_size=1024,
                    window_size=112, fullatt_block_indexes=[3, 7])
# A small checkpoint the converter and the server take (the tests): the same layout, one LM layer
# of width 64, 4 vision blocks (the converter maps the merger's `mlp.2` only where depth > 2).
TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                         "mrope_section": [4, 6, 6]})
TINY_VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                   fullatt_block_indexes=[1, 3])
SIZES = {"bench": (BENCH_TEXT, BENCH_VISION), "tiny": (TINY_TEXT, TINY_VISION)}


class PeerError(Exception):
    """The peer is not built, or cannot build, convert or serve as asked; the message says what to do."""


@dataclass(frozen=True)
class Peer:
    """A built peer: the vendored llama.cpp source, its `llama-server` and how it was built."""

    root: Path
    source: Path  # vendor/llama.cpp inside the unpacked sdist
    server: Path
    build: dict  # peer.json: package version, cmake flags, targets, build seconds, compiler

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    def server_version(self) -> str:
        out = subprocess.run([str(self.server), "--version"], capture_output=True, text=True, timeout=60)
        return next((line.split(":", 1)[1].strip() for line in (out.stdout + out.stderr).splitlines()
                     if line.startswith("version:")), "unknown")


def find_peer(root: Path = DEFAULT_PEER_DIR) -> Peer:
    """The peer built under `root` (`build_peer`), or PeerError naming the command that builds it."""
    record = root / "peer.json"
    hint = f"build it with `mmkv bench-peers --build-peer --peer-dir {root}` (pip downloads {PACKAGE}; cmake and g++ build it)"
    if not record.is_file():
        raise PeerError(f"no llama.cpp peer under {root}: {hint}")
    build = json.loads(record.read_text())
    peer = Peer(root, root / build["source"], root / "build" / "bin" / "llama-server", build)
    if not peer.server.is_file() or not peer.converter.is_file():
        raise PeerError(f"the peer under {root} is incomplete ({peer.server} or {peer.converter} missing): {hint}")
    return peer


def _run(argv: list[str], what: str, **kw) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, **kw)
    if done.returncode:
        raise PeerError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n{done.stderr[-3000:]}")
    return done.stdout


def build_peer(root: Path, jobs: int = 2, version: str | None = None) -> Peer:
    """Download the llama-cpp-python sdist with pip (no binary, no dependencies), unpack it under
    `root` and build its vendored llama.cpp's `llama-server` with the system cmake and compiler
    (niced, `jobs` at a time); records the version, flags and build time in root/peer.json."""
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        raise PeerError("building the peer needs cmake and a C++ compiler (Debian / Ubuntu: apt-get install cmake g++)")
    root.mkdir(parents=True, exist_ok=True)
    spec = f"{PACKAGE}=={version}" if version else PACKAGE
    out = _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", spec,
                "-d", str(root / "sdist")], "pip download")
    found = re.findall(r"(?:Saved|File was already downloaded) (\S+\.tar\.gz)", out)
    if not found:
        raise PeerError(f"pip download gave no sdist of {spec}:\n{out[-2000:]}")
    sdist = Path(found[-1])
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    unpacked = root / sdist.name.removesuffix(".tar.gz")
    source, build = unpacked / "vendor" / "llama.cpp", root / "build"
    t0 = time.perf_counter()
    _run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], "cmake configure")
    _run(["nice", "-n", "10", "cmake", "--build", str(build), "-j", str(jobs), "--target", *TARGETS], "cmake build")
    compiler = _run(["c++", "--version"], "c++ --version").splitlines()[0]
    record = {"package": PACKAGE, "version": unpacked.name.rsplit("-", 1)[1], "source": str(source.relative_to(root)),
              "cmake_flags": list(CMAKE_FLAGS), "targets": list(TARGETS), "jobs": jobs,
              "build_s": round(time.perf_counter() - t0, 1), "compiler": compiler}
    (root / "peer.json").write_text(json.dumps(record, indent=2) + "\n")
    return find_peer(root)


# ---- the checkpoint both serve ----------------------------------------------------------------------
def save_checkpoint(out: Path, family: str = "qwen2_5_vl", size: str = "bench", seed: int = 0) -> Path:
    """A random checkpoint of `family` (Qwen2.5-VL or Qwen3-VL) at `size` (`SIZES`; Qwen3-VL: its
    real-shape test size) with the released tokenizer, template, processor files, config and weight
    names (mmkv.testing.realshape), in a hub-cache layout under `out`. Returns the snapshot dir."""
    from mmkv.testing.realshape import reshaped, save_real_checkpoint

    if family == "qwen2_5_vl":
        text, vision = SIZES[size]
        spec = reshaped(family, text, vision, tie_word_embeddings=True)
    elif family == "qwen3_vl":
        spec = None
    else:
        raise PeerError(f"no peer checkpoint for {family!r}; expected qwen2_5_vl or qwen3_vl")
    shard = "8MB" if size == "tiny" else "64MB"  # sharded, with an index, as released
    return save_real_checkpoint(family, out, seed=seed, repo_id=f"mmkv-peer/{checkpoint_name(family, size)}",
                                spec=spec, max_shard_size=shard)


def checkpoint_name(family: str, size: str) -> str:
    """`save_checkpoint`'s repo name: Qwen3-VL has one size, its real-shape test size."""
    return f"{family}-{size}" if family == "qwen2_5_vl" else f"{family}-realshape"


def convert(peer: Peer, checkpoint: Path, out_dir: Path, outtype: str = "f32") -> tuple[Path, Path]:
    """The checkpoint as GGUF by the peer's own converter: the text model and the vision projector
    (`--mmproj`), each written once (kept when present). Returns (model, mmproj)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files = (out_dir / f"model-{outtype}.gguf", out_dir / f"mmproj-{outtype}.gguf")
    for extra, path in zip(((), ("--mmproj",)), files):
        if path.exists():
            continue
        partial = path.with_suffix(".partial")
        # Written under another name first: a killed conversion leaves nothing that passes for a converted file.
        _run([sys.executable, str(peer.converter), str(checkpoint), "--outtype", outtype, "--outfile", str(partial),
              *extra], f"convert_hf_to_gguf.py {' '.join(extra)}".strip(), timeout=1800)
        partial.rename(path)
    return files
