"""Network addresses: ``HOST:PORT`` parsing, loopback checks and a free loopback port.

The recipe's validation checks addresses before JAX is imported, and the
remote trainer's protocol uses the same rules; this module imports neither
JAX nor gRPC (nor anything of the orchestrator), so both can import it.
"""

from __future__ import annotations

import ipaddress
import socket


class AddressError(ValueError):
  """A listen or connect address that cannot be used (the text says why and what to use)."""


def split_address(address: str) -> tuple[str, int]:
  """``host:port`` → (host, port); IPv6 hosts in brackets.

  Raises:
    AddressError: no port, or a port out of range.
  """
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
    raise AddressError(f"address {address!r} is not HOST:PORT (e.g. 127.0.0.1:50051; port 0 picks a free one)")
  return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
  """Whether ``host`` (``localhost`` or an IP address, not a name to resolve) is on loopback."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def free_loopback_port() -> int:
  """A port on 127.0.0.1 that was free when asked (another process may take it before it is bound again)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]
