"""API keys: `Authorization: Bearer <key>` against the keys from flags and a keys file."""

from __future__ import annotations

import hmac
from pathlib import Path


class ApiKeys:
    def __init__(self, keys: list[str]) -> None:
        # A key from an environment variable or a mounted secret often ends in a newline, and a
        # header's token is stripped before the compare: stripped here too, so the two can meet.
        self._keys = [key.strip().encode() for key in keys if key.strip()]

    @classmethod
    def load(cls, keys: list[str], keys_file: str | None) -> ApiKeys:
        return cls([*keys, *(read_keys_file(keys_file) if keys_file else [])])

    @property
    def is_required(self) -> bool:
        return bool(self._keys)

    def allows(self, authorization: str | None) -> bool:
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        # The header arrives decoded as latin-1 (HTTP's rule); encoding it back gives its bytes,
        # so a key with non-ASCII characters matches when the client sends it as UTF-8.
        given = token.strip().encode("latin-1")
        # Compare against every key so the time taken does not tell which one nearly matched.
        matches = [hmac.compare_digest(given, key) for key in self._keys]
        return any(matches)


def read_keys_file(path: str) -> list[str]:
    """One key a line; blank lines and lines starting with `#` are skipped."""
    # utf-8-sig: a file saved by an editor that writes a byte-order mark would otherwise hold
    # a first key that never matches.
    lines = (line.strip() for line in Path(path).read_text(encoding="utf-8-sig").splitlines())
    return [line for line in lines if line and not line.startswith("#")]
