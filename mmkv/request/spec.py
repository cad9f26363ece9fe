"""One request's settings, validated once: `RequestSpec`, what every later stage of `Engine.start`
(prompt, placement, accounting, decoding) reads instead of a long list of keyword arguments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mmkv.errors import InvalidRequestError
from mmkv.request.compose import check_history_policy
from mmkv.request.blend import Blend, parse_blend
from mmkv.request.edits import EditPolicy, parse_edit_policy
from mmkv.request.grammar import Grammar, GrammarCompiler, parse_response_format
from mmkv.request.plan import check_policy, check_seam_tokens, check_stops
from mmkv.request.sampling import SamplingParams, TokenLogprob
from mmkv.request.tools import ToolSpec


@dataclass(frozen=True)
class RequestSpec:
    messages: Any  # OpenAI-shaped messages, parsed by the prompt stage
    max_new_tokens: int
    sampling: SamplingParams
    stops: list[str]
    reuse: bool  # False: the reference, one full forward with no cached KV
    seam: int  # seam tokens recomputed at the start of each spliced chunk
    policy: str  # rope policy: where a chunk's keys are turned to
    edit: EditPolicy
    history: str  # "exact", or "compose": earlier turns' KV spliced where they moved (mmkv.request.compose)
    blend: Blend  # the fidelity dial: the share of each spliced chunk recomputed in context
    tenant: str
    fidelity: bool  # also run the full recompute and report the first logits' gap
    tools: ToolSpec | None
    grammar: Grammar | None  # what the answer must follow (response_format, a forced tool call), compiled
    on_text: Callable[[str], None] | None = None
    should_stop: Callable[[], bool] | None = None
    on_logprobs: Callable[[list[TokenLogprob]], None] | None = None


def build_spec(messages, *, vocab_size: int, default_seam: int, default_policy: str,
               tool_spec: Callable[[Any, Any], ToolSpec | None], grammars: GrammarCompiler,
               max_new_tokens: int = 64,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               stop: list[str] | str | None = None, reuse: bool = True, seam_tokens: int | None = None,
               rope_policy: str | None = None, tenant: str = "", on_text=None, should_stop=None,
               fidelity: bool = False, edit_policy: str | None = None, top_k: int = 0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
               logit_bias: dict[int, float] | None = None, logprobs: bool = False, top_logprobs: int = 0,
               on_logprobs=None, tools: list[dict] | None = None,
               tool_choice: str | dict | None = None, response_format: dict | None = None,
               history_policy: str | None = None, blend=None, blend_select: str | None = None,
               default_blend: Blend | None = None) -> RequestSpec:
    """`Engine.start`'s keyword arguments checked (each bad value an InvalidRequestError naming
    its parameter) and gathered; the engine's own defaults fill what the request leaves out."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise InvalidRequestError("max_new_tokens must be a positive integer", param="max_tokens")
    for name, value in (("reuse", reuse), ("fidelity", fidelity)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be true or false", param=name)
    if not isinstance(tenant, str):
        raise InvalidRequestError("tenant must be a string", param="tenant")
    tools = tool_spec(tools, tool_choice)
    edit, history = parse_edit_policy(edit_policy), check_history_policy(history_policy)
    if history == "compose" and (not reuse or edit.name != "recompute"):
        raise InvalidRequestError("history_policy compose needs reuse and no edit_policy: it places cached turns "
                                  "itself", param="history_policy")
    if not reuse and (blend is not None or blend_select is not None):
        raise InvalidRequestError("blend applies to spliced chunks; with reuse=false every token is recomputed "
                                  "already", param="blend" if blend is not None else "blend_select")
    blended = parse_blend(blend, blend_select, default_blend)
    return RequestSpec(
        messages=messages, max_new_tokens=max_new_tokens,
        sampling=SamplingParams.build(
            vocab_size, temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, logit_bias=logit_bias, seed=seed, logprobs=logprobs,
            top_logprobs=top_logprobs),
        stops=check_stops(stop), reuse=reuse,
        seam=check_seam_tokens(default_seam if seam_tokens is None else seam_tokens),
        policy=check_policy(rope_policy or default_policy), edit=edit, history=history, blend=blended, tenant=tenant,
        fidelity=fidelity, tools=tools, grammar=grammars.for_request(parse_response_format(response_format), tools),
        on_text=on_text, should_stop=should_stop,
        on_logprobs=on_logprobs)
