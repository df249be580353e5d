"""Batches and their lines.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("completion_window_s", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("runner", sa.String(64), nullable=True),
        sa.Column("runner_seen_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_batches_tenant_idempotency"),
    )
    op.create_index("ix_batches_tenant_created_at", "batches", ["tenant", "created_at"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("batch_id", sa.String(64), nullable=False),
        sa.Column("line_no", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(255), nullable=False),
        sa.Column("session_key", sa.String(255), nullable=False),
        sa.Column("parallel", sa.Boolean(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("call_id", sa.String(64), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error_code", sa.String(32), nullable=True),
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_custom_id"),
    )
    op.create_index("ix_batch_lines_batch_status", "batch_lines", ["batch_id", "status"])
    op.create_index("ix_batch_lines_call_id", "batch_lines", ["call_id"], unique=True)


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
