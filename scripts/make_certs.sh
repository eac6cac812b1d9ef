#!/usr/bin/env bash
# Make the TLS certificates and SuperNode authentication keys of a deployment.
#   scripts/make_certs.sh [OUT_DIR] [NUM_SUPERNODES=3]
# OUT_DIR defaults to $XDG_STATE_HOME/alignfl/certs (~/.local/state/alignfl/certs), outside the checkout: the
# private keys never sit where `git add` could publish them. An OUT_DIR inside a git work tree that does not
# ignore it is refused. Private keys are readable by their owner only (mode 0600).
# Writes, keeping whatever already exists (so a second call with a larger count only adds nodes):
#   OUT_DIR/ca.crt, ca.key                  the CA every component trusts
#   OUT_DIR/superlink.crt, superlink.key    the SuperLink's server certificate; SANs: superlink, localhost,
#                                           127.0.0.1 and the names in $SUPERLINK_SANS (e.g. "DNS:fl.example.org")
#   OUT_DIR/supernode-<i>/runtime.crt, .key the SuperNode's Runtime API certificate (its executor connects on
#                                           127.0.0.1); SANs: localhost, 127.0.0.1
#   OUT_DIR/supernode-<i>/auth, auth.pub    the SuperNode's EC P-384 key pair (OpenSSH format, which Flower
#                                           reads); register auth.pub with `flwr supernode register`
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
OUT=${1:-${XDG_STATE_HOME:-$HOME/.local/state}/alignfl/certs}
NUM=${2:-3}
case "$NUM" in ''|*[!0-9]*) echo "make_certs.sh: NUM_SUPERNODES must be a whole number, got '$NUM'" >&2; exit 2;; esac
for tool in openssl ssh-keygen; do
  command -v "$tool" >/dev/null || { echo "make_certs.sh: '$tool' is required (openssl, openssh-client)" >&2; exit 2; }
done
# A key folder inside a git work tree must be one that git ignores (`git add -A` would publish the keys).
case "$OUT" in /*) absolute=$OUT ;; *) absolute=$PWD/$OUT ;; esac
parent=$absolute
until [ -d "$parent" ]; do parent=$(dirname "$parent"); done
if command -v git >/dev/null && git -C "$parent" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  if ! git -C "$parent" check-ignore -q "$absolute/ca.key"; then
    echo "make_certs.sh: '$OUT' is inside the git work tree $(git -C "$parent" rev-parse --show-toplevel)," \
      "which does not ignore it: the private keys could be committed. Give a folder outside it (default" \
      "\$XDG_STATE_HOME/alignfl/certs) or one its .gitignore covers (certs/)" >&2
    exit 2
  fi
fi
umask 077  # the folder and private keys: their owner only
mkdir -p "$OUT"

# sign NAME SANS: a P-256 key and a server certificate signed by the CA (kept when present)
sign() {
  local name=$1 sans=$2
  [ -f "$name.crt" ] && return 0
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$name.key" \
    -subj "/CN=$(basename "$name")" -out "$name.csr" 2>/dev/null
  openssl x509 -req -in "$name.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -CAcreateserial -days 825 -sha256 \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$sans") \
    -out "$name.crt" 2>/dev/null
  rm -f "$name.csr"
  chmod 600 "$name.key"
  chmod 644 "$name.crt"
}

if [ ! -f "$OUT/ca.crt" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 3650 -sha256 \
    -keyout "$OUT/ca.key" -subj "/CN=alignfl deployment CA" -out "$OUT/ca.crt" 2>/dev/null
  chmod 600 "$OUT/ca.key"
  chmod 644 "$OUT/ca.crt"
fi
sign "$OUT/superlink" "DNS:superlink,DNS:localhost,IP:127.0.0.1${SUPERLINK_SANS:+,$SUPERLINK_SANS}"
for ((i = 0; i < NUM; i++)); do
  node="$OUT/supernode-$i"
  mkdir -p "$node"
  sign "$node/runtime" "DNS:localhost,IP:127.0.0.1"
  if [ ! -f "$node/auth" ]; then
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$node/auth"
    chmod 600 "$node/auth"
  fi
  chmod 644 "$node/auth.pub"
done
echo "[make_certs] CA, SuperLink certificate and $NUM SuperNode key pairs in $OUT"
