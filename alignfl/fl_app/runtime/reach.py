"""Where a deployment's SuperLink listens and whether a node machine reaches it.

The ``superlink`` role listens only where it is told (:func:`listen_host`): on ``--host``, else on the one address
of this machine that ``--address`` names, 127.0.0.1 without ``--address``, and on every interface only when
``--host 0.0.0.0`` says so. A ``supernodes`` role first waits for its SuperLink to answer
(:func:`wait_for_superlink`, with TLS checking that its certificate names the address dialled) and says on the
console while it does not, and for how long it keeps trying, where Flower's SuperNode would retry silently.
"""

from __future__ import annotations

import socket
import ssl
import sys
import time

from alignfl.fl_app.config import ConfigError

REACH_TIMEOUT_S = 10.0
"""Seconds one attempt to reach the SuperLink may take."""
RETRY_INTERVAL_S = 1.0
"""Seconds between attempts while the SuperLink does not answer."""
ALL_INTERFACES = ("0.0.0.0", "::")


def split_address(address: str, option: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) checked; a clear error naming the option otherwise."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{option} {address!r} is not allowed: give host:port with a port in 1-65535")
    return host, int(port)


class Unreachable(Exception):
    """The SuperLink did not answer (yet): a node machine may start before it."""


def tls_problem(address: str, ca: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why a SuperNode cannot talk TLS to the SuperLink at ``address`` (a certificate that does not name the
    address or is not signed by ``ca``), or None; :class:`Unreachable` when nothing answers."""
    host, port = split_address(address, "--superlink")
    context = ssl.create_default_context(cafile=ca)
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as connection,
            context.wrap_socket(connection, server_hostname=host),
        ):
            return None
    except ssl.SSLCertVerificationError as error:
        return (
            f"the SuperLink at {address} presents a certificate this node does not accept: "
            f"{error.verify_message}; the SuperLink's certificate must name the address the nodes dial "
            "(its --address) and be signed by the CA in --certs"
        )
    except (OSError, ssl.SSLError) as error:
        raise Unreachable(f"the SuperLink at {address} cannot be reached: {error}") from None


def plain_problem(address: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """None once the SuperLink at ``address`` accepts a connection; :class:`Unreachable` while nothing answers."""
    host, port = split_address(address, "--superlink")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        raise Unreachable(f"the SuperLink at {address} cannot be reached: {error}") from None
    return None


def wait_for_superlink(address: str, ca: str | None, timeout_s: float) -> str | None:
    """None once the SuperLink answers (with ``ca``: TLS, its certificate accepted); a certificate problem at
    once, unreachable after ``timeout_s``. While it does not answer, the console says so, and for how long."""
    started = time.monotonic()
    said = False
    while True:
        try:
            problem = tls_problem(address, ca) if ca is not None else plain_problem(address)
        except Unreachable as unreachable:
            waited = time.monotonic() - started
            if waited > timeout_s:
                return f"{unreachable} (tried for {timeout_s:.0f} s)"
            if not said:
                print(
                    f"[alignfl] {unreachable}; trying again every {RETRY_INTERVAL_S:.0f} s for up to "
                    f"{timeout_s:.0f} s (--superlink-wait)",
                    file=sys.stderr,
                    flush=True,
                )
                said = True
            time.sleep(RETRY_INTERVAL_S)
            continue
        if said and problem is None:
            print(f"[alignfl] the SuperLink at {address} answers ({time.monotonic() - started:.0f} s)", flush=True)
        return problem


def local_address(address: str) -> bool:
    """Whether this machine can listen on IP ``address``."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def listen_host(host: str | None, addresses: list[str]) -> str:
    """Where the SuperLink listens: ``--host`` as given (``0.0.0.0`` is every interface, by name only), else the
    one address of this machine that the ``--address`` names resolve to, else 127.0.0.1 (no ``--address``)."""
    if host is not None:
        return host
    if not addresses:
        return "127.0.0.1"
    resolved: dict[str, set[str]] = {}
    for address in addresses:
        try:
            resolved[address] = {info[4][0] for info in socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)}
        except OSError:
            resolved[address] = set()  # a name only the node machines resolve
    local = sorted({ip for ips in resolved.values() for ip in ips if local_address(ip)})
    shown = ", ".join(f"{name} ({', '.join(sorted(ips)) or 'unresolved'})" for name, ips in resolved.items())
    candidates = [ip for ip in local if ":" not in ip] or local  # a name with an A and an AAAA record: its IPv4
    if len(candidates) == 1:
        return candidates[0]
    if not local:
        raise ConfigError(
            f"--address {shown}: none is an address of this machine, so the SuperLink would not know where to "
            "listen; give --host with this machine's address that the nodes reach (--host 0.0.0.0: every "
            "interface)"
        )
    raise ConfigError(
        f"--address {shown}: these are several addresses of this machine ({', '.join(local)}) and the SuperLink "
        "listens on one; give --host with the one the nodes reach (--host 0.0.0.0: every interface)"
    )
