"""The model's CPU paths, shared by every family: linear layers on oneDNN with prepacked weights
(the language model's and the vision tower's), and grouped-query attention without copies of the
keys and values.

Linear layers. PyTorch's `nn.Linear` on a CPU calls MKL's sgemm, whose kernels for a few rows are
poor on some CPUs: on a 2-core AMD EPYC a decode step of 2 to 8 rows cost 1.8x to 2.3x one row's,
where the weights are read once either way. oneDNN with the weight reordered once for its kernels
(what PyTorch's own inductor does for frozen CPU models) keeps a few rows at one row's cost and
runs a prefill of 40 tokens in 0.8x the time (mmkv bench-concurrency; docs/bench.md); the vision
tower of the bench model encodes a 256-token screenshot (1,024 patch rows) in 0.80x the CPU time
(1,081 ms against 1,351, medians of 8 interleaved). Each packed
layer holds its weight once, in oneDNN's layout: no second copy. `state_dict` and `weight` give
the dense weight back (so the model's fingerprint, and saving, are unchanged). Layers whose weight
is shared with another module (a tied LM head) stay dense. Each layer is checked at packing
against the dense product (`CHECK_TOLERANCE`); a layer that differs, a dtype other than float32, a
non-CPU device or a PyTorch without oneDNN leaves the layer dense, and `pack_linears` says what it
did.

Attention. transformers' SDPA path repeats each key and value head for its query group
(`repeat_kv`, a copy of the whole context per layer) whenever a mask is given, because CUDA's
fused kernels take grouped-query attention only without one; every prefill of mmkv passes a mask.
PyTorch's CPU kernels take `enable_gqa` with a mask and give the same result bit for bit, so
`gqa_without_copies` makes transformers' choice say yes for CPU tensors (other devices keep its
rule): a 38-token turn over a 3.4k-token context costs 0.82x.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

log = logging.getLogger("mmkv.adapters")

CPU_LINEAR = ("onednn", "dense")
CHECK_TOLERANCE = 1e-4  # relative, max-abs over a random batch: fp32 products in another order


class OneDNNLinear(nn.Module):
    """`nn.Linear` with its weight reordered for oneDNN, held once. Moved to another dtype or
    device (`.to`, `.half()`), it holds the weight dense there and runs as `nn.Linear` does."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, bias: nn.Parameter | None):
        super().__init__()
        self.in_features, self.out_features, self.bias = in_features, out_features, bias
        self.packed: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        self._hold(weight)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight [out, in] (a conversion when packed: nothing on the forward path reads it)."""
        return self.packed.to_dense() if self.packed is not None else self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return nn.functional.linear(x, self.dense, self.bias)
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def _apply(self, fn, recurse=True):
        weight = fn(self.weight)
        super()._apply(fn, recurse)  # the bias
        return self._hold(weight)

    def _hold(self, weight: torch.Tensor) -> OneDNNLinear:
        """Keep `weight` packed when it is a float32 CPU tensor, else dense."""
        if weight.device.type == "cpu" and weight.dtype == torch.float32:
            self.packed, self.dense = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), None
        else:
            self.packed, self.dense = None, weight.detach()
        return self

    def __deepcopy__(self, memo):
        weight = self.weight if self.packed is not None else self.dense.clone()  # to_dense is a copy already
        return OneDNNLinear(self.in_features, self.out_features, weight, copy.deepcopy(self.bias, memo))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{'onednn' if self.packed is not None else 'dense'}")


def parameter_count(model: nn.Module) -> int:
    """The model's weights, packed layers' included (their weights are no longer parameters)."""
    packed = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, OneDNNLinear))
    return sum(p.numel() for p in model.parameters()) + packed


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed(linear: nn.Linear) -> OneDNNLinear | None:
    """`linear` with its weight reordered for oneDNN, or None when its product differs from the dense one."""
    layer = OneDNNLinear(linear.in_features, linear.out_features, linear.weight, linear.bias)
    x = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0), dtype=linear.weight.dtype)
    want = linear(x)
    scale = want.abs().max().clamp_min(1e-6)
    return layer if bool(((layer(x) - want).abs().max() / scale) <= CHECK_TOLERANCE) else None


def pack_linears(model: nn.Module, prefixes: tuple[str, ...], mode: str = "onednn") -> str:
    """Replace every `nn.Linear` of `model` whose qualified name starts with one of `prefixes` by a
    `OneDNNLinear`, when `mode` is "onednn" and the layer can be packed; returns the backend now in
    use: "onednn", "dense", or "dense: <why>" / "onednn (n of m layers ...)"."""
    if mode not in CPU_LINEAR:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, not {mode!r}")
    mine = [(name, m) for name, m in model.named_modules() if name.startswith(prefixes)]
    already = sum(isinstance(m, OneDNNLinear) and m.packed is not None for _, m in mine)
    linears = [(name, m) for name, m in mine if type(m) is nn.Linear]
    if already and (mode == "dense" or not linears):  # an earlier engine on this model packed them
        return "onednn" if not linears else f"onednn ({already} of {already + len(linears)} layers; the rest dense)"
    if mode == "dense" or not linears:
        return "dense" if mode == "dense" else "dense: no linear layer"
    if linears[0][1].weight.device.type != "cpu":
        return "dense: not a CPU model"
    if not onednn_available():
        return "dense: this PyTorch has no oneDNN"
    owners: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        owners[p.data_ptr()] = owners.get(p.data_ptr(), 0) + 1
    kept = 0
    with torch.no_grad():
        for name, linear in linears:
            if linear.weight.dtype != torch.float32 or owners.get(linear.weight.data_ptr(), 0) > 1:
                kept += 1  # another dtype, or a weight tied to another module's
                continue
            layer = _packed(linear)
            if layer is None:
                log.warning("oneDNN's product differs from the dense one on %s; it stays dense", name)
                kept += 1
                continue
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, layer)
    total = len(linears) + already
    if kept == len(linears) and not already:
        return "dense: no layer could be packed (float32 weights, not tied)"
    return "onednn" if not kept else f"onednn ({total - kept} of {total} layers; the rest dense)"


def gqa_without_copies() -> bool:
    """Make transformers' SDPA attention pass `enable_gqa` for CPU tensors instead of repeating
    the key and value heads (module docstring); idempotent. False when this transformers has no
    such choice to make (its SDPA path then stays as it is)."""
    from transformers.integrations import sdpa_attention

    rule = getattr(sdpa_attention, "use_gqa_in_sdpa", None)
    if rule is None:
        return False
    if getattr(rule, "mmkv_cpu", False):
        return True

    def use_gqa_in_sdpa(attention_mask, key, value):
        return key.device.type == "cpu" or rule(attention_mask, key, value)

    use_gqa_in_sdpa.mmkv_cpu, use_gqa_in_sdpa.transformers_rule = True, rule
    sdpa_attention.use_gqa_in_sdpa = use_gqa_in_sdpa
    return True
