"""Passwords out of what is logged or printed: `redact_url` for storage / database URLs.

`redact_url("postgresql://tuner:s3cret@db:5432/optuna")` -> "postgresql://tuner:***@db:5432/optuna";
a `password=` query parameter is masked too; URLs without a password come back unchanged.
`redact_in(text, url)` also removes the password where a driver's error message repeats it.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

# scheme://user:password@host...: the password is everything between the first ':' after '//' and
# the last '@' before the host (passwords may contain '@' when not percent-encoded).
_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.\-]*:(?://)?[^:/@]*):(?P<password>.*)@(?P<tail>[^@]*)$")
_QUERY_PASSWORD = re.compile(r"(?P<key>[?&](?:password|passwd|pwd)=)(?P<password>[^&#]*)", re.IGNORECASE)
MASK = "***"


def passwords_of(url: str) -> list[str]:
    """The password in the user info and any `password=` query parameter."""
    found = []
    match = _USERINFO.match(url)
    if match and match.group("password"):
        found.append(match.group("password"))
    found.extend(m.group("password") for m in _QUERY_PASSWORD.finditer(url) if m.group("password"))
    return found


def redact_url(url: str) -> str:
    match = _USERINFO.match(url)
    if match and match.group("password"):
        url = f"{match.group('head')}:{MASK}@{match.group('tail')}"
    return _QUERY_PASSWORD.sub(lambda m: m.group("key") + (MASK if m.group("password") else ""), url)


def redact_in(text: str, url: str) -> str:
    """`text` with `url` redacted and any other copy of its password (raw or percent-decoded) masked."""
    text = text.replace(url, redact_url(url))
    for password in passwords_of(url):
        for secret in sorted({password, unquote(password)}, key=len, reverse=True):
            if secret:
                text = text.replace(secret, MASK)
    return text
