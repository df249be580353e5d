"""The tenants file: parsing, its errors, key hashing and the development tenant."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from broker.admission.tenants import DEV_TENANT_ID, Tenancy, hash_key, load_tenancy
from kvgate.cli import COMMAND
from schemas.vocab import Tier


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_a_tenant_is_found_by_its_key_and_only_by_it(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"""
[tiers.besteffort]
share = 0.3
[[tenants]]
id = "acme"
key_sha256 = "{hash_key("k1")}"
max_tier = "guaranteed"
max_sessions = 7
""",
    )
    tenancy = Tenancy.from_file(path)
    acme = tenancy.authenticate("k1")
    assert acme is not None and acme.id == "acme" and acme.max_sessions == 7
    assert acme.allows(Tier.GUARANTEED)
    assert tenancy.authenticate("k2") is None and tenancy.authenticate(None) is None
    # A tier's fields not given keep their defaults.
    assert tenancy.tiers[Tier.BESTEFFORT].share == 0.3
    assert tenancy.tiers[Tier.BESTEFFORT].default_deadline_s == 900


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[[tenants]\nid=", "Expected"),
        ('[[tenants]]\nid = "a"\nkey_sha256 = "short"', "key_sha256"),
        ('[[tenants]]\nid = "a"\nkey_sha256 = "' + "0" * 64 + '"\nmax_tier = "gold"', "max_tier"),
        ('[[tenants]]\nid = "a"\nkey_sha256 = "' + "0" * 64 + '"\nsurprise = 1', "surprise"),
        (
            '[[tenants]]\nid = "a"\nkey_sha256 = "' + "0" * 64 + '"\n'
            '[[tenants]]\nid = "a"\nkey_sha256 = "' + "1" * 64 + '"',
            "unique",
        ),
        ("[tiers.besteffort]\nshare = 0.9", "shares"),
    ],
)
def test_a_bad_tenants_file_is_refused_with_the_file_and_the_problem(
    tmp_path: Path, text: str, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError, match=problem) as caught:
        Tenancy.from_file(path)
    assert str(path) in str(caught.value)


def test_without_a_file_every_caller_is_the_development_tenant(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tenancy = load_tenancy(None, Tier.STANDARD)
    assert "no tenants file" in caplog.text
    for key in (None, "", "anything"):
        tenant = tenancy.authenticate(key)
        assert tenant is not None and tenant.id == DEV_TENANT_ID
        assert tenant.max_tier is Tier.STANDARD


def test_kvgate_key_hash_prints_the_sha256() -> None:
    out = subprocess.run(
        [*COMMAND, "key", "hash"], input="s3cret\n", capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hash_key("s3cret") and len(out) == 64
