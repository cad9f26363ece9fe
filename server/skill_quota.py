"""Skill quotas: how many skills one API key may keep, how many bytes they may take, and a byte
budget for all keys together, checked before a skill is precompiled or recorded.

A skill's bytes are what its chunk takes in the RAM store, as the store charges it: its KV (its
tokens times the model's K/V bytes per token), its token ids and positions, each tensor's own heap;
its copies in the disk and shared tiers are about the same size.
Usage is read from the engine's own skill lists at each check, so skills restored at start-up and
skills other servers added to the shared tier count too. Runs on the engine worker thread: a
check and the add that follows it are one job, so two uploads cannot both take the last room.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mmkv.errors import MMKVError


class SkillQuotaError(MMKVError):
    """This API key keeps as many skills, or skill bytes, as its quota allows; other keys are
    unaffected. No Retry-After: only deleting skills makes room."""

    http_status = 429
    error_type = "invalid_request_error"
    code = "skill_quota_exceeded"


class SkillStoreFullError(MMKVError):
    """The skills of all keys together take the whole skill budget."""

    http_status = 507
    error_type = "server_error"
    code = "skill_store_full"


def kv_bytes_per_token(engine) -> int:
    """K and V of every LM layer for one token, in the engine's dtype."""
    config, adapter = engine.adapter.text_config, engine.adapter
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * adapter.dtype.itemsize


def skill_bytes(engine, tokens: int) -> int:
    """What a skill of `tokens` tokens takes in the RAM store, as the store charges it."""
    from mmkv.kv.chunks import text_chunk_bytes  # here: importing the server must not import torch

    return text_chunk_bytes(tokens, engine.adapter.num_layers, kv_bytes_per_token(engine))


def skill_tokens(engine, text: str) -> int:
    """The tokens the engine will precompile for `text` (special tokens' strings as plain text)."""
    return len(engine.adapter.tokenizer(text, split_special_tokens=True)["input_ids"])


@dataclass(frozen=True, slots=True)
class SkillQuota:
    store_bytes: int  # all keys together (507)
    key_bytes: int  # one key (429)
    key_skills: int  # one key (429)

    def check(self, engine, tenant: str, text: str, tenants: Iterable[str]) -> None:
        """Raises SkillQuotaError or SkillStoreFullError unless the skill `text` fits; `tenants` are
        every key's tenant (for the budget of all keys). Re-adding a skill the key keeps is free."""
        from mmkv.request.registry import skill_id_for  # here: importing the server must not import torch

        kept = engine.list_skills(tenant)
        if any(info.skill_id == skill_id_for(text) for info in kept):
            return
        nbytes = skill_bytes(engine, skill_tokens(engine, text))
        used = sum(skill_bytes(engine, info.tokens) for info in kept)
        if len(kept) + 1 > self.key_skills:
            raise SkillQuotaError(f"this API key already keeps {len(kept)} skills, its quota; delete skills first",
                                  param="text")
        if used + nbytes > self.key_bytes:
            raise SkillQuotaError(
                f"this skill's KV takes {nbytes} bytes; with this API key's {used} bytes of skills that exceeds its "
                f"quota of {self.key_bytes} bytes; delete skills first", param="text")
        total = sum(skill_bytes(engine, info.tokens) for t in set(tenants) for info in engine.list_skills(t))
        if total + nbytes > self.store_bytes:
            raise SkillStoreFullError(
                f"this skill's KV takes {nbytes} bytes, over the skill budget of {self.store_bytes} bytes "
                f"({total} used by all keys); delete skills first", param="text")
