"""Network addresses as mldebug's doors print and judge them (docs/security.md)."""
from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether HOST is reachable from this host only (127.0.0.0/8, ::1, localhost)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def shown(host: str, port: int) -> str:
    """'127.0.0.1:5678', '[::1]:5678': what `attach` and `--listen` take back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
