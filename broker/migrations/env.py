"""Alembic environment for kvgate's database. Run through ``broker.db.migrate`` (the front door
migrates at start-up), or ``alembic -c`` pointing here with ``sqlalchemy.url`` set.

The versions are written by hand. The target metadata holds the tables of the modules imported
so far; to compare the models with a database (``alembic check``, autogenerate), import the
modules that declare tables first: ``broker.ledger``, ``api.batches.store``,
``api.batches.files`` (this module, in ``broker/``, may not import the front door's)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from broker.db import metadata

config = context.config


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=metadata)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given = config.attributes.get("connection")
    if given is not None:  # broker.db.migrate holds the connection (and its lock)
        context.configure(connection=given, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = engine_from_config(
        config.get_section(config.config_ini_section) or {},
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
