"""A self-signed certificate for TLS tests, made with the openssl command line."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed(folder: Path, name: str, ip: str | None = None) -> tuple[Path, Path]:
    """(cert.pem, key.pem) for DNS name `name` (and `ip` when given), valid one day."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    san = f"DNS:{name}" + (f",IP:{ip}" if ip else "")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}"],
        check=True, capture_output=True, timeout=60,
    )
    return cert, key
