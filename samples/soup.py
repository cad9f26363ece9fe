"""Average the weights of several checkpoints of one tiny model (a uniform "model soup").

    python samples/soup.py --out /tmp/soup runs/A runs/B runs/C

Every input must be a checkpoint directory of the same architecture (the same tensor names, shapes
and dtypes), for example runs of ``samples/train.py`` resumed from one common checkpoint. Each
tensor of the output is the plain mean of the inputs' tensors, computed in float64 and cast back.
The other files (config, tokenizer, processor, chat template) are copied from the first input,
whose ``config.json`` every other input must match. ``soup.json`` in the output records each input's
directory and the sha256 of its ``model.safetensors``, so a soup can be rebuilt and checked.

A soup is a checkpoint like any other: it is chosen, or not, on validation sets drawn with their
own seeds (``evaluate_tiny.py --validation``), never on the committed split.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"
#: Files copied from the first input (the weights are written, the training state is not a soup's).
COPIED = ("config.json", "generation_config.json", "chat_template.jinja", "processor_config.json",
          "preprocessor_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "video_preprocessor_config.json")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def average(inputs: list[Path]) -> dict[str, torch.Tensor]:
    """The uniform mean of the inputs' tensors; ValueError when the inputs do not line up."""
    if len(inputs) < 2:
        raise ValueError("a soup needs at least two checkpoints")
    for d in inputs:
        if not (d / WEIGHTS).is_file():
            raise ValueError(f"{d}: no {WEIGHTS}")
    first = _config(inputs[0])
    for d in inputs[1:]:
        if _config(d) != first:
            raise ValueError(f"{d}/config.json differs from {inputs[0]}/config.json")
    sums: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for i, d in enumerate(inputs):
        with safe_open(str(d / WEIGHTS), "pt") as f:
            names = set(f.keys())
            if i and names != set(sums):
                raise ValueError(f"{d}: tensor names differ from {inputs[0]} "
                                 f"({sorted(names ^ set(sums))[:3]} ...)")
            for name in names:
                t = f.get_tensor(name)
                if not i:
                    sums[name], dtypes[name] = t.to(torch.float64), t.dtype
                elif t.shape != sums[name].shape or t.dtype != dtypes[name]:
                    raise ValueError(f"{d}: {name} is {tuple(t.shape)} {t.dtype}, "
                                     f"not {tuple(sums[name].shape)} {dtypes[name]}")
                else:
                    sums[name] += t.to(torch.float64)
    return {name: (s / len(inputs)).to(dtypes[name]).contiguous() for name, s in sums.items()}


def write(inputs: list[Path], out: Path) -> dict:
    tensors = average(inputs)
    if out.resolve() in {d.resolve() for d in inputs}:
        raise ValueError("--out must not be one of the inputs")
    out.mkdir(parents=True, exist_ok=True)
    for name in COPIED:
        if (inputs[0] / name).is_file():
            shutil.copyfile(inputs[0] / name, out / name)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    record = {"soup": "uniform mean", "inputs": [{"dir": str(d), "sha256": sha256(d / WEIGHTS)} for d in inputs],
              "sha256": sha256(out / WEIGHTS)}
    (out / "soup.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    ap.add_argument("inputs", type=Path, nargs="+", help="checkpoint directories to average")
    args = ap.parse_args(argv)
    try:
        record = write(args.inputs, args.out)
    except ValueError as e:
        sys.exit(f"soup: {e}")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
