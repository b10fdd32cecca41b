"""API keys against `Authorization` headers as the gateway receives them (decoded as latin-1)."""

from __future__ import annotations

from pathlib import Path

from services.gateway.auth import ApiKeys, read_keys_file


def header(value: str) -> str:
    """What the ASGI server hands over for a header the client sent as UTF-8."""
    return value.encode().decode("latin-1")


def test_a_key_matches_only_itself_under_the_bearer_scheme() -> None:
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.allows(header("Bearer sk-two")) and keys.allows(header("bearer  sk-one "))
    assert not keys.allows(header("Bearer sk-three"))
    assert not keys.allows(header("Basic sk-one")) and not keys.allows(None)
    assert ApiKeys([]).allows(None)


def test_a_key_with_non_ascii_characters_matches_when_sent_as_utf8() -> None:
    keys = ApiKeys(["clé-secrète"])
    assert keys.allows(header("Bearer clé-secrète"))
    assert not keys.allows(header("Bearer cle-secrete"))


def test_a_configured_key_with_surrounding_whitespace_matches_the_key_sent() -> None:
    """As a key read from a secret file or an environment variable ending in a newline."""
    keys = ApiKeys(["sk-one\n", " ", ""])
    assert keys.allows(header("Bearer sk-one"))
    assert keys.is_required and not keys.allows(header("Bearer  "))


def test_a_keys_file_saved_with_a_byte_order_mark_yields_its_first_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_bytes("\ufeffsk-first\n# a comment\nsk-second\n".encode())
    keys = ApiKeys(read_keys_file(str(path)))
    assert keys.allows(header("Bearer sk-first")) and keys.allows(header("Bearer sk-second"))
