"""Indexes for reading a batch's lines in pages and for the retention sweep.

- ``batch_lines (batch_id, line_no)``: the runner reads a batch's lines in line order once,
  and results are downloaded a page at a time from a line number on; without it, every page
  sorts the whole batch. Unique: line numbers are given once per batch, and a page starts
  after the last line number of the one before.
- ``batches (finished_at)``, ``files (created_at)``, ``batches (input_file_id)``: the sweep
  finds what ended or was uploaded before the retention, and the files no batch names.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-10
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_batch_lines_batch_line_no", "batch_lines", ["batch_id", "line_no"], unique=True
    )
    op.create_index("ix_batches_finished_at", "batches", ["finished_at"])
    op.create_index("ix_batches_input_file_id", "batches", ["input_file_id"])
    op.create_index("ix_files_created_at", "files", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_files_created_at", table_name="files")
    op.drop_index("ix_batches_input_file_id", table_name="batches")
    op.drop_index("ix_batches_finished_at", table_name="batches")
    op.drop_index("ix_batch_lines_batch_line_no", table_name="batch_lines")
