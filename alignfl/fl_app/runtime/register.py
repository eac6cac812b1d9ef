"""Register SuperNode public keys with a SuperLink that authenticates SuperNodes (``--enable-supernode-auth``):
the one-shot ``supernode-register`` service of compose.tls.yml, started as ``python -m alignfl.fl_app.deploy register``
(:func:`alignfl.fl_app.runtime.topology.register_command`), or ``python -m alignfl.fl_app.runtime.register``.

    python -m alignfl.fl_app.runtime.register --superlink superlink:9093 --root-certificates certs/ca.crt certs/*/auth.pub
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from alignfl.fl_app.runtime.flwr_cli import register_supernodes, write_connection
from alignfl.fl_app.runtime.superlink import flower_environment, health_url, healthy, trust, wait_until


def main(argv: list[str] | None = None) -> int:
    """``--superlink HOST:PORT --root-certificates CA KEY.pub ...``: waits for the SuperLink, registers the keys;
    exit code 0 (registered, or registered before), 1 (failed) or 2 (a file is missing)."""
    parser = argparse.ArgumentParser(
        prog="python -m alignfl.fl_app.runtime.register",
        description="Register SuperNode public keys with a SuperLink that authenticates "
        "SuperNodes; waits for the SuperLink first.",
    )
    parser.add_argument("--superlink", required=True, help="the SuperLink's address, host:port")
    parser.add_argument("--root-certificates", required=True, help="the CA certificate the SuperLink's is signed by")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the SuperLink")
    parser.add_argument(
        "public_keys", nargs="+", help="SuperNode public keys (OpenSSH format, make_certs.sh's auth.pub)"
    )
    args = parser.parse_args(argv)
    missing = [key for key in [args.root_certificates, *args.public_keys] if not Path(key).is_file()]
    if missing:
        print(f"[alignfl] no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    home = Path(tempfile.mkdtemp(prefix="alignfl-register-"))
    try:
        write_connection(home, args.superlink, args.root_certificates)
        url = health_url(args.superlink, args.root_certificates)
        verify = trust(args.root_certificates)
        wait_until(lambda: healthy(url, verify), args.timeout, f"the SuperLink at {url}")
        register_supernodes(args.public_keys, flower_environment(home))
    except (RuntimeError, TimeoutError) as error:
        print(f"[alignfl] registration FAILED: {error}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(home, ignore_errors=True)
    print(f"[alignfl] registered {len(args.public_keys)} SuperNode key(s) with {args.superlink}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
