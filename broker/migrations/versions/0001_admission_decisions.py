"""The admission decisions table.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "admission_decisions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("decided_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("replica", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("session_id", sa.String(64), nullable=True),
        sa.Column("decision", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("retry_after_s", sa.Integer(), nullable=True),
        sa.Column("latency_us", sa.Integer(), nullable=False),
        sa.Column("signals", sa.JSON(), nullable=False),
    )
    op.create_index("ix_admission_decisions_decided_at", "admission_decisions", ["decided_at"])
    op.create_index(
        "ix_admission_decisions_tenant_decided_at",
        "admission_decisions",
        ["tenant", "decided_at"],
    )


def downgrade() -> None:
    op.drop_table("admission_decisions")
