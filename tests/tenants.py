"""Tenants files for front doors under test, written from plain data (the front door reads them
with ``tomllib``; ``broker/admission/tenants.py`` holds what each field means)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.admission.tenants import hash_key


def tenant(tenant_id: str, key: str, **fields: Any) -> dict[str, Any]:
    """One ``[[tenants]]`` entry whose bearer key is ``key`` (the file holds only its hash);
    ``fields`` as in the file, a nested table as a dict."""
    return {"id": tenant_id, "key_sha256": hash_key(key), **fields}


def tenants_toml(*tenants: Mapping[str, Any], **top: Any) -> str:
    """A tenants file: ``top`` as top-level keys (``tiers={...}``), then one ``[[tenants]]``
    table for each of ``tenants``."""
    lines = [f"{name} = {_value(value)}" for name, value in top.items()]
    for entry in tenants:
        lines += ["", "[[tenants]]", *(f"{name} = {_value(v)}" for name, v in entry.items())]
    return "\n".join(lines) + "\n"


def write_tenants_file(directory: Path, *tenants: Mapping[str, Any], **top: Any) -> Path:
    """``directory/tenants.toml`` holding ``tenants_toml(*tenants, **top)``; its path."""
    path = directory / "tenants.toml"
    path.write_text(tenants_toml(*tenants, **top))
    return path


def _value(value: Any) -> str:
    """A TOML value: an inline table for a mapping; a JSON string, number or boolean is TOML
    too."""
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_value(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)
