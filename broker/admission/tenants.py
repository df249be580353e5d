"""Tenants and tiers, read from the tenants file (``KVGATE_TENANTS_FILE``, TOML).

::

    [tiers.guaranteed]          # every field optional; defaults below
    ttft_ms = 1000
    tpot_ms = 100
    share = 1.0
    default_deadline_s = 120

    [[tenants]]
    id = "acme"
    key_sha256 = "9f86d0..."    # `kvgate key hash <key>`: keys are never stored in clear
    max_tier = "guaranteed"
    max_sessions = 50
    max_parallel_calls = 200
    tokens_per_minute = 2000000     # charged at admission with the session's declared tokens,
                                    # and with what its calls use past that declaration
    max_reserved_tokens = 400000    # optional: KV tokens its live sessions hold reserved at once
    [tenants.objectives.standard]   # optional: this tenant's own objectives for a tier
    ttft_ms = 500

A tier's ``share`` bounds the KV tokens that sessions of that tier *and every lower tier* may
hold together, as a fraction of fleet capacity. The shares nest (guaranteed 1.0 ≥ standard 0.8 ≥
besteffort 0.5 by default), so the top 20% of the fleet is only ever reserved by guaranteed
sessions and best-effort work can never crowd standard work out of more than half of it.

A tier's objectives (``ttft_ms``, ``tpot_ms``) are what admission aims at: every ended call of an
admitted session is judged against them, or against its tenant's own where the tenant sets them,
and each tier's admission window follows the share that met them (``broker.admission.objectives``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from broker.admission.objectives import Objective
from broker.errors import TierNotAllowed
from schemas.vocab import TIERS_BY_PRIORITY, Tier

log = logging.getLogger(__name__)

DEV_TENANT_ID = "dev"


class TierPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float = Field(gt=0)
    tpot_ms: float = Field(gt=0)
    share: float = Field(gt=0, le=1)
    default_deadline_s: float = Field(gt=0)


DEFAULT_TIERS: Mapping[Tier, TierPolicy] = {
    Tier.GUARANTEED: TierPolicy(ttft_ms=1000, tpot_ms=100, share=1.0, default_deadline_s=120),
    Tier.STANDARD: TierPolicy(ttft_ms=3000, tpot_ms=200, share=0.8, default_deadline_s=300),
    Tier.BESTEFFORT: TierPolicy(ttft_ms=30000, tpot_ms=500, share=0.5, default_deadline_s=900),
}


class ObjectiveOverride(BaseModel):
    """A tenant's own objectives for one tier; what it leaves out is the tier's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    max_tier: Tier = Tier.STANDARD
    max_sessions: int = Field(default=100, ge=1)
    max_parallel_calls: int = Field(default=256, ge=1)
    tokens_per_minute: int = Field(default=10_000_000, ge=1)
    max_reserved_tokens: int | None = Field(default=None, ge=1)
    """The most KV tokens this tenant's live sessions may hold reserved together (unset: only
    the tiers' shares of the fleet bound them)."""
    objectives: dict[Tier, ObjectiveOverride] = Field(default_factory=dict)

    def allows(self, tier: Tier) -> bool:
        return tier.priority >= self.max_tier.priority

    def require_tier(self, tier: Tier) -> None:
        """Refuse (403 ``tier_not_allowed``) a tier above this tenant's highest."""
        if not self.allows(tier):
            raise TierNotAllowed(
                f"tier {tier.value!r} is above this tenant's highest tier {self.max_tier.value!r}",
                param="tier",
            )


class TierOverride(BaseModel):
    """A tier's fields as the file gives them; what it leaves out keeps its default."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    share: float | None = Field(default=None, gt=0, le=1)
    default_deadline_s: float | None = Field(default=None, gt=0)

    def apply(self, base: TierPolicy) -> TierPolicy:
        return base.model_copy(update=self.model_dump(exclude_none=True))


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tiers: dict[Tier, TierOverride] = Field(default_factory=dict)
    tenants: list[Tenant] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> Self:
        ids = [t.id for t in self.tenants]
        keys = [t.key_sha256 for t in self.tenants]
        if len(set(ids)) != len(ids) or len(set(keys)) != len(keys):
            raise ValueError("tenant ids and keys must be unique")
        return self


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tenancy:
    """Who may call, with which quotas, and what each tier promises.

    ``open`` is the development mode (no tenants file): every caller, with or without a key,
    is the one development tenant.
    """

    def __init__(
        self,
        tenants: list[Tenant],
        tiers: Mapping[Tier, TierPolicy] | None = None,
        *,
        open_tenant: Tenant | None = None,
    ) -> None:
        merged = dict(DEFAULT_TIERS)
        merged.update(tiers or {})
        shares = [merged[t].share for t in TIERS_BY_PRIORITY]
        if shares != sorted(shares, reverse=True):
            raise ValueError("tier shares must not grow from guaranteed down to besteffort")
        self.tiers: Mapping[Tier, TierPolicy] = merged
        self._by_hash = {t.key_sha256: t for t in tenants}
        self.open_tenant = open_tenant

    @classmethod
    def development(cls, max_tier: Tier = Tier.STANDARD) -> Tenancy:
        # Quotas wide open: in development the fleet's capacity is the only limit.
        dev = Tenant(
            id=DEV_TENANT_ID,
            key_sha256="0" * 64,
            max_tier=max_tier,
            max_sessions=1_000_000,
            max_parallel_calls=1_000_000,
            tokens_per_minute=10**12,
        )
        return cls([], open_tenant=dev)

    @classmethod
    def from_file(cls, path: Path) -> Tenancy:
        """Raises ``ValueError`` naming the file and the first problem in it."""
        try:
            raw = tomllib.loads(path.read_text())
            parsed = TenantsFile.model_validate(raw)
            tiers = {t: o.apply(DEFAULT_TIERS[t]) for t, o in parsed.tiers.items()}
            return cls(parsed.tenants, tiers)
        except (OSError, tomllib.TOMLDecodeError, ValidationError, ValueError) as exc:
            raise ValueError(f"tenants file {path}: {exc}") from exc

    def objective(self, tenant: Tenant, tier: Tier) -> Objective:
        """What a call of ``tenant`` in ``tier`` is judged against."""
        policy = self.tiers[tier]
        own = tenant.objectives.get(tier)
        ttft_ms = own.ttft_ms if own is not None and own.ttft_ms is not None else policy.ttft_ms
        tpot_ms = own.tpot_ms if own is not None and own.tpot_ms is not None else policy.tpot_ms
        return Objective(ttft_s=ttft_ms / 1000, tpot_s=tpot_ms / 1000)

    def by_id(self, tenant_id: str) -> Tenant | None:
        if self.open_tenant is not None:
            return self.open_tenant if tenant_id == self.open_tenant.id else None
        return next((t for t in self._by_hash.values() if t.id == tenant_id), None)

    def authenticate(self, key: str | None) -> Tenant | None:
        if self.open_tenant is not None:
            return self.open_tenant
        if not key:
            return None
        digest = hash_key(key)
        tenant = self._by_hash.get(digest)
        # A constant-time comparison, so that response timing says nothing about the key.
        if tenant is not None and hmac.compare_digest(tenant.key_sha256, digest):
            return tenant
        return None


def load_tenancy(path: Path | None, dev_tier: Tier) -> Tenancy:
    if path is None:
        log.warning(
            "no tenants file (KVGATE_TENANTS_FILE): every caller is the open development "
            "tenant %r (highest tier %s); do not run this way in production",
            DEV_TENANT_ID,
            dev_tier.value,
        )
        return Tenancy.development(dev_tier)
    return Tenancy.from_file(path)
