"""The cluster config's ``share_cores`` section: node groups whose prefill and decode worker lend
each other the node's cores step by step (engine/core_share.py; docs/ARCHITECTURE.md, "Cores
lent between pools on one node").

Prefill worker i and decode worker i form node group i: the Ray launcher places the two on one
node (pdserve/cluster/core_pairs.py) and the local harness pairs its workers the same way. Each
group has a ledger under /dev/shm named from the section's ``name`` (one per cluster: the
launcher makes a random one when the config gives none) and the group's index.
"""

from __future__ import annotations

import dataclasses
import re
import secrets

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.core_share import CoreShareSettings, ledger_path

_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}")


class ShareCoresSection(BaseModel):
    """Each step decode takes the threads its TPOT target needs (``decode_threads``, or
    derived from its measured step time) and prefill takes the rest of ``node_cores``, at
    least one. CPU threads only: GPU SM shares (MPS, green contexts) are not built."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    node_cores: int = Field(0, ge=0, description="cores a pair shares; 0: the node's count")
    decode_threads: int = Field(
        0, ge=0, description="0: from decode's step time and tpot_target_s; N: N when busy"
    )
    tpot_target_s: float | None = Field(
        None, gt=0, description="decode's target time per token; null: autoscaler.tpot_target_s"
    )
    headroom: float = Field(0.8, gt=0, le=1, description="decode aims at this share of it")
    name: str | None = Field(
        None, description="the ledgers' name under /dev/shm; null: a random one per cluster"
    )

    @field_validator("name")
    @classmethod
    def _file_name(cls, value: str | None) -> str | None:
        if value is not None and not _NAME.fullmatch(value):
            raise ValueError(
                f"{value!r}: up to 64 letters, digits, '_', '-' or '.' (part of a file name)"
            )
        return value


def check_share_cores(cfg) -> None:
    """What a ClusterConfig with ``share_cores.enabled`` must also be (ValueError naming the
    fields otherwise)."""
    s = cfg.share_cores
    if not s.enabled:
        return
    prefill, decode = cfg.pools.prefill, cfg.pools.decode
    problems = []
    if s.node_cores == 1:
        problems.append("share_cores.node_cores: 1 core cannot be shared (give >= 2, or 0)")
    if s.node_cores and s.decode_threads > s.node_cores:
        problems.append(
            f"share_cores.decode_threads ({s.decode_threads}) must be <= share_cores.node_cores "
            f"({s.node_cores})"
        )
    if prefill.replicas != decode.replicas:
        problems.append(
            "share_cores pairs prefill worker i with decode worker i: pools.prefill.replicas "
            f"({prefill.replicas}) must equal pools.decode.replicas ({decode.replicas})"
        )
    if cfg.autoscaler.enabled:
        problems.append(
            "share_cores needs autoscaler.enabled: false (the autoscaler resizes each pool on "
            "its own, which would leave workers without a partner)"
        )
    if prefill.num_gpus or decode.num_gpus or cfg.device.startswith("cuda"):
        problems.append(
            "share_cores lends CPU threads; GPU SM shares (MPS, green contexts) are not built: "
            "give num_gpus: 0 and a cpu (or auto) device"
        )
    if problems:
        raise ValueError("\n".join(problems))


def with_share_name(cfg):
    """``cfg`` with a ledger name when sharing is on and it has none (the launchers call it
    once per cluster, so every worker of a group finds the same ledger)."""
    s = cfg.share_cores
    if not s.enabled or s.name:
        return cfg
    named = s.model_copy(update={"name": f"c{secrets.token_hex(6)}"})
    return cfg.model_copy(update={"share_cores": named})


def core_share_settings(cfg, group: int) -> CoreShareSettings:
    s = cfg.share_cores
    if not s.name:
        raise ValueError("share_cores.name is unset: the launcher names the ledgers first")
    return CoreShareSettings(
        ledger=ledger_path(s.name, group),
        node_cores=s.node_cores,
        decode_threads=s.decode_threads,
        tpot_target_s=s.tpot_target_s or cfg.autoscaler.tpot_target_s,
        headroom=s.headroom,
    )


def with_core_share(role_settings, cfg, group: int | None):
    """A worker's settings (PrefillSettings, DecodeSettings) as node group ``group``'s member;
    unchanged when sharing is off or the worker is in no group."""
    if group is None or not cfg.share_cores.enabled:
        return role_settings
    return dataclasses.replace(role_settings, core_share=core_share_settings(cfg, group))


def group_ledgers(cfg, groups: int) -> list[str]:
    """The ledger files of ``groups`` node groups (the launchers remove them at the end)."""
    s = cfg.share_cores
    return [ledger_path(s.name, g) for g in range(groups)] if s.enabled and s.name else []
