#!/usr/bin/env bash
# The contract as client generators see it: lints openapi.yaml with Redocly's linter, generates a Python
# client from it with openapi-python-client, and runs the onboarding flow and a notification's life
# (scripts/client_flow.py) through that client against a freshly started `cifpool serve` (embedded
# Postgres in a temp dir). Fails on a lint error, a generator error, or any answer the generated models
# cannot read.
#
#   scripts/client-check.sh
#
# Needs node/npm (for the linter), python3 with venv, curl and the PostgreSQL server binaries (.ci/run
# installs them). Both tools are pinned and installed under target/ on first use. The binary is the one
# `cargo test` builds (target/debug/cifpool, test profile), so after CI's test step nothing is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

REDOCLY_VERSION=2.77.0
GENERATOR_VERSION=0.29.1
BIN=target/debug/cifpool

log() { printf '[client-check] %s\n' "$*" >&2; }

# --- lint ----------------------------------------------------------------------------------------------
lint_dir=target/redocly
if [ "$("$lint_dir/node_modules/.bin/redocly" --version 2>/dev/null | head -n 1)" != "$REDOCLY_VERSION" ]; then
  log "installing @redocly/cli $REDOCLY_VERSION into $lint_dir"
  rm -rf "$lint_dir"
  mkdir -p "$lint_dir"
  npm install --prefix "$lint_dir" --no-audit --no-fund --silent "@redocly/cli@$REDOCLY_VERSION" >/dev/null
fi
# The ignore list, with the reason for each entry, is .redocly.lint-ignore.yaml.
"$lint_dir/node_modules/.bin/redocly" lint openapi.yaml --format stylish 2>&1 | grep -v '[║╔╚]' || {
  log "openapi.yaml does not pass the linter"
  exit 1
}

# --- generate ------------------------------------------------------------------------------------------
VENV=target/client-venv
if ! "$VENV/bin/openapi-python-client" --version 2>/dev/null | grep -qF "$GENERATOR_VERSION"; then
  log "installing openapi-python-client $GENERATOR_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "openapi-python-client==$GENERATOR_VERSION"
fi
generated=target/client
rm -rf "$generated"
mkdir -p "$generated"
# The reconcile endpoint (a text/plain body) is skipped by this generator, with a warning; every other
# operation must generate.
(cd "$generated" && "$root/$VENV/bin/openapi-python-client" generate --path "$root/openapi.yaml" --meta setup) \
  >"$generated.log" 2>&1 || { cat "$generated.log" >&2; exit 1; }
skipped=$(grep -c 'Endpoint will not be generated' "$generated.log" || true)
if [ "$skipped" != 1 ] || ! grep -q 'POST /admin/pools/reconcile' "$generated.log"; then
  log "the generator skipped other operations than the reconcile:"
  cat "$generated.log" >&2
  exit 1
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check "$generated/cifpool-client"

# --- run ------------------------------------------------------------------------------------------------
log "building $BIN"
cargo test --quiet --no-run --test it
work=$(mktemp -d -t cifpool-client.XXXXXX)
chmod 755 "$work" # as root the embedded Postgres runs as `postgres`, which must reach $work/pg
server_pid=
cleanup() {
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -INT "$server_pid" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$server_pid" 2>/dev/null || true
  fi
  for _ in $(seq 1 100); do [ -e "$work/pg/postmaster.pid" ] || break; sleep 0.1; done
  rm -rf "$work"
}
trap cleanup EXIT
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
base="http://127.0.0.1:$port"
token=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
CIFPOOL_SECURITY__ADMIN_TOKEN=$token CIFPOOL_MASTER_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))') \
  "$BIN" --data-dir "$work/pg" serve --listen "127.0.0.1:$port" >"$work/server.log" 2>&1 &
server_pid=$!
for _ in $(seq 1 600); do
  curl -fsS -o /dev/null --max-time 2 "$base/readyz" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; exit 1; }
  sleep 0.1
done
api_key=$(curl -fsS -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
  -d '{"name":"client-check","scopes":["cif:reserve","cif:read","notify:send","notify:read","admin"]}' \
  "$base/admin/keys" | python3 -c 'import json, sys; print(json.load(sys.stdin)["key"])')
"$VENV/bin/python" scripts/client_flow.py "$base" "$api_key" || {
  log "the flow failed; server log (last 40 lines):"
  tail -n 40 "$work/server.log" >&2
  exit 1
}
log "passed"
