"""Deepen a trained checkpoint without changing what it computes: insert language-model layers that
start as the identity.

    python samples/grow.py --out /tmp/grown --after 1 --after 3 samples/models/qwen2_5_vl-tiny

Each inserted decoder layer gets the config's own random initialisation, except its attention output
projection (``o_proj``) and its MLP output projection (``down_proj``), which start at zero: both
residual branches then add exactly 0, so the grown model's logits equal the source's bit for bit,
and training (``samples/train.py --resume --out OUT``) starts from the source's answers rather than
from scratch. The first gradient step moves the zero projections, and through them the rest of the
new layer (the same start as ReZero or LoRA's zero-initialised B). This is the "deeper" half of
Net2Net's function-preserving growth; it lets a model that has run out of depth for a multi-step
lookup get more of it without the hours of retraining from scratch.

``--after i`` inserts one new layer right after the source's layer ``i`` (0-based); repeat it for
several. ``--mlp N`` widens every LM layer's MLP to ``N`` units (the "wider" half): the new units'
input rows (``gate_proj``, ``up_proj``) get the random initialisation and their ``down_proj`` columns
start at zero, so they too add nothing until trained (the logits then agree up to float32 rounding:
a longer reduction sums in another order). ``--vision-after i`` inserts a vision block after the
vision tower's block ``i`` the same way (its attention ``proj`` and its MLP's last projection start at
zero); the config's per-block lists follow the source blocks: Qwen3-VL's deepstack taps stay after the
same blocks, and in Qwen2.5-VL a new block attends in full where the block before it does. Qwen3-VL
adds its deepstack visual features after its first ``len(deepstack_visual_indexes)`` LM layers, so an
LM layer inserted before the last of those would receive them instead: refused.

The other files (tokenizer, processor, chat template) are copied; ``train_state.json`` keeps the
source's training record, with the growth as its latest run (0 steps), so the chain of commands in
``earlier_runs`` stays complete.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import sys
from pathlib import Path

import torch

#: Files copied unchanged from the source (the config and weights are written anew).
COPIED = ("generation_config.json", "chat_template.jinja", "processor_config.json", "preprocessor_config.json",
          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "video_preprocessor_config.json")
#: Where a decoder layer's tensors live in a Qwen-VL state dict.
LAYER = re.compile(r"^(.*language_model\.layers\.)(\d+)\.(.*)$")
#: The residual branches' output projections: zero in a new layer, so the layer adds nothing.
ZEROED = ("self_attn.o_proj.", "mlp.down_proj.")
#: The same for a vision block (``visual.blocks.N``): Qwen2-VL's MLP ends in ``fc2``, Qwen2.5-VL's in
#: ``down_proj``, Qwen3-VL's in ``linear_fc2``.
VISION_BLOCK = re.compile(r"^(.*visual\.blocks\.)(\d+)\.(.*)$")
VISION_ZEROED = ("attn.proj.", "mlp.fc2.", "mlp.down_proj.", "mlp.linear_fc2.")


def deepstack_layers(config) -> int:
    """How many leading LM layers receive deepstack visual features (0 outside Qwen3-VL)."""
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])


def layer_plan(n_layers: int, after: list[int], deepstack: int = 0, option: str = "--after",
               unit: str = "layers") -> list[int | None]:
    """The grown stack as source layer indexes, ``None`` for a new layer; ValueError on a bad plan
    (named for ``option``, which inserts after one of the model's ``unit``)."""
    for i in after:
        if not 0 <= i < n_layers:
            raise ValueError(f"{option} {i}: the model has {unit} 0-{n_layers - 1}")
        if i < deepstack - 1:
            raise ValueError(f"--after {i}: deepstack features enter after layers 0-{deepstack - 1}; "
                             f"a layer inserted before the last of them would receive one instead")
    plan: list[int | None] = []
    for i in range(n_layers):
        plan.append(i)
        plan.extend([None] * after.count(i))
    return plan


def _remap(indexes: list[int], plan: list[int | None], follow: bool) -> list[int]:
    """Block indexes of the source (deepstack taps, full-attention blocks) in the grown stack; with
    ``follow`` a new block joins the set when the block before it is in it (it takes its type)."""
    out, last = [], False
    for j, src in enumerate(plan):
        last = src in indexes if src is not None else (last and follow)
        if last:
            out.append(j)
    return out


def grown_config(config, plan: list[int | None], mlp: int | None = None, vision_plan: list[int | None] | None = None):
    new = copy.deepcopy(config)
    if vision_plan is not None:
        vision = new.vision_config
        vision.depth = len(vision_plan)
        if getattr(vision, "deepstack_visual_indexes", None):  # tapped after the same source blocks
            vision.deepstack_visual_indexes = _remap(vision.deepstack_visual_indexes, vision_plan, follow=False)
        if getattr(vision, "fullatt_block_indexes", None) is not None:  # Qwen2.5-VL: windowed or full per block
            vision.fullatt_block_indexes = _remap(vision.fullatt_block_indexes, vision_plan, follow=True)
    text = new.text_config
    if mlp is not None:
        text.intermediate_size = mlp
    old_types = getattr(config.text_config, "layer_types", None)
    text.num_hidden_layers = len(plan)
    if old_types:
        types, last = [], old_types[0]
        for src in plan:
            last = old_types[src] if src is not None else last  # a new layer takes its predecessor's type
            types.append(last)
        text.layer_types = types
    return new


#: MLP tensors whose first (input rows) or second (output columns) axis is the MLP width.
MLP_ROWS = ("mlp.gate_proj.", "mlp.up_proj.")
MLP_COLS = "mlp.down_proj."


def _copy_into(tensor: torch.Tensor, old: torch.Tensor, rest: str) -> None:
    """``old`` into ``tensor``; a widened MLP keeps the new units' rows random and their columns zero."""
    if old.shape == tensor.shape:
        tensor.copy_(old)
    elif rest.startswith(MLP_ROWS) and old.shape[1:] == tensor.shape[1:] and old.shape[0] < tensor.shape[0]:
        tensor[: old.shape[0]] = old
    elif rest.startswith(MLP_COLS) and old.shape[0] == tensor.shape[0] and old.shape[1] < tensor.shape[1]:
        tensor[:, : old.shape[1]] = old
        tensor[:, old.shape[1]:] = 0
    else:
        raise ValueError(f"{rest}: {tuple(old.shape)} does not fit {tuple(tensor.shape)}")


def grow(src: Path, out: Path, after: list[int], seed: int = 0, mlp: int | None = None,
         vision_after: list[int] | None = None) -> dict:
    """Write the grown checkpoint to ``out``; returns the record also kept in its train_state.json."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    if out.resolve() == src.resolve():
        raise ValueError("--out must not be the source checkpoint")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src}: no config.json")
    config = AutoConfig.from_pretrained(src, local_files_only=True)
    n_old = config.text_config.num_hidden_layers
    width = config.text_config.intermediate_size
    vision_after = sorted(vision_after or [])
    if not after and mlp is None and not vision_after:
        raise ValueError("nothing to grow: give --after, --vision-after or --mlp")
    if mlp is not None and mlp <= width:
        raise ValueError(f"--mlp {mlp}: the MLP already has {width} units; give more")
    plan = layer_plan(n_old, sorted(after), deepstack_layers(config))
    depth = config.vision_config.depth
    vision_plan = layer_plan(depth, vision_after, option="--vision-after", unit="vision blocks") if vision_after else None
    source = AutoModelForImageTextToText.from_pretrained(src, local_files_only=True)
    old = source.state_dict()
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(grown_config(config, plan, mlp, vision_plan)).to(next(source.parameters()).dtype)
    state = model.state_dict()
    for name, tensor in state.items():
        m, stack, zeroed = LAYER.match(name), plan, ZEROED
        if m is None and vision_plan is not None:
            m, stack, zeroed = VISION_BLOCK.match(name), vision_plan, VISION_ZEROED
        if m is None:
            src_name = name
        elif stack[int(m.group(2))] is not None:
            src_name = f"{m.group(1)}{stack[int(m.group(2))]}.{m.group(3)}"
        else:  # a new layer or block: its own init, its residual outputs at zero
            if m.group(3).startswith(zeroed):
                tensor.zero_()
            continue
        if src_name not in old:
            raise ValueError(f"{name}: no matching tensor {src_name} in {src}")
        _copy_into(tensor, old[src_name], m.group(3) if m else name)
    model.load_state_dict(state)
    model.generation_config = source.generation_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    prior = json.loads((src / "train_state.json").read_text()) if (src / "train_state.json").is_file() else {}
    params = sum(p.numel() for p in model.parameters())
    record = {"grown_from": str(src), "after": sorted(after), "layers": [n_old, len(plan)],
              "mlp": [width, mlp or width],
              "new_layers": [j for j, s in enumerate(plan) if s is None], "seed": seed, "params": params}
    if vision_plan is not None:
        record.update(vision_after=vision_after, vision_blocks=[depth, len(vision_plan)],
                      new_vision_blocks=[j for j, s in enumerate(vision_plan) if s is None])
    earlier = list(prior.get("earlier_runs", []))
    if prior:
        earlier.append({k: prior.get(k) for k in ("command", "steps", "elapsed_s", "history")})
    keep = {k: prior[k] for k in ("family", "size", "max_pixels", "min_pixels", "word_tokens") if k in prior}
    args = " ".join([f"--after {i}" for i in sorted(after)] + [f"--vision-after {i}" for i in vision_after]
                    + ([f"--mlp {mlp}"] if mlp else []))
    (out / "train_state.json").write_text(json.dumps({
        **keep, "command": f"python samples/grow.py --out {out} {args} --seed {seed} {src}", "steps": 0,
        "elapsed_s": 0.0, "history": [], "earlier_runs": earlier, "params": params, "grow": record,
        "total_steps": sum(r.get("steps") or 0 for r in earlier),
        "total_elapsed_s": round(sum(r.get("elapsed_s") or 0 for r in earlier), 1), "final": True}, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="output checkpoint directory")
    ap.add_argument("--after", type=int, action="append", default=[], metavar="I",
                    help="insert a new layer after source layer I (0-based; repeatable)")
    ap.add_argument("--vision-after", type=int, action="append", default=[], metavar="I",
                    help="insert a new vision block after source block I (0-based; repeatable)")
    ap.add_argument("--mlp", type=int, default=None, metavar="N", help="widen every LM layer's MLP to N units")
    ap.add_argument("--seed", type=int, default=0, help="seed of the new layers' initialisation")
    ap.add_argument("src", type=Path, help="source checkpoint directory")
    args = ap.parse_args(argv)
    try:
        record = grow(args.src, args.out, args.after, args.seed, args.mlp, args.vision_after)
    except ValueError as e:
        sys.exit(f"grow: {e}")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
