"""Tenants and their API keys, from the ``--keys`` TOML file.

::

    [tenants.alice]
    key = "tml-alice-0123456789"
    budget_usd = 5.0        # optional

The Tinker SDK refuses keys that do not start with ``tml-``, so the file must use that prefix.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class KeysError(ValueError):
    """A keys file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str
    budget_usd: float | None = None


def read_toml(path: Path, what: str, error: type[ValueError] = ValueError) -> dict:
    """A TOML file's table; ``error`` says why it could not be read (``what``: "the keys file")."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path} is not valid TOML: {exc}") from exc


def load_tenants(path: str | Path) -> dict[str, Tenant]:
    """``{api key: Tenant}`` from a keys file."""
    path = Path(path)
    data = read_toml(path, "the keys file", KeysError)
    unknown = set(data) - {"tenants"}
    if unknown:
        raise KeysError(f"{path}: unknown top-level key(s) {sorted(unknown)}; expected [tenants.NAME] tables")
    tenants = data.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise KeysError(f"{path} has no [tenants.NAME] tables")
    by_key: dict[str, Tenant] = {}
    for name, entry in tenants.items():
        where = f"{path}: tenants.{name}"
        if not _NAME.match(name):
            raise KeysError(f"{where}: a tenant name is 1-64 letters, digits, '_' or '-'")
        if not isinstance(entry, dict):
            raise KeysError(f"{where} must be a table with key = \"tml-...\"")
        extra = set(entry) - {"key", "budget_usd"}
        if extra:
            raise KeysError(f"{where}: unknown field(s) {sorted(extra)}; allowed: key, budget_usd")
        key = entry.get("key")
        if not isinstance(key, str) or not key.startswith("tml-") or len(key) < 12:
            raise KeysError(f"{where}.key must be a string that starts with 'tml-' (the SDK refuses "
                            "others) and has at least 12 characters")
        budget = entry.get("budget_usd")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0):
            raise KeysError(f"{where}.budget_usd must be a number >= 0")
        if key in by_key:
            raise KeysError(f"{where}.key is also the key of tenant {by_key[key].name!r}")
        by_key[key] = Tenant(name, key, None if budget is None else float(budget))
    return by_key
