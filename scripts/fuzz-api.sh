#!/usr/bin/env bash
# API fuzzing: runs schemathesis against a freshly started `cifpool serve` (embedded Postgres in a temp dir)
# and fails on any 5xx, any answer that does not match openapi.yaml, and any panic or ERROR line in the
# server's log.
#
#   scripts/fuzz-api.sh                                   # bounded run, random seed (printed)
#   FUZZ_SEED=42 FUZZ_MAX_EXAMPLES=300 scripts/fuzz-api.sh
#   FUZZ_REPORT_DIR=/tmp/fuzz scripts/fuzz-api.sh         # also write HAR + NDJSON reports there
#   FUZZ_ARGS='--include-path-regex ^/v1/cif' scripts/fuzz-api.sh   # extra schemathesis arguments
#
# Needs python3 (with venv), curl and the PostgreSQL server binaries (.ci/run installs them). schemathesis
# is installed from PyPI into target/fuzz-venv on first use. The binary is the one `cargo test` builds
# (target/debug/cifpool, test profile), so after CI's test step nothing is rebuilt.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

SCHEMATHESIS_VERSION=4.32.5
VENV=target/fuzz-venv
MAX_EXAMPLES=${FUZZ_MAX_EXAMPLES:-200}
SEED=${FUZZ_SEED:-$RANDOM$RANDOM}
BIN=target/debug/cifpool

log() { printf '[fuzz-api] %s\n' "$*" >&2; }

# --- schemathesis ------------------------------------------------------------------------------------
if ! "$VENV/bin/schemathesis" --version 2>/dev/null | grep -qF "$SCHEMATHESIS_VERSION"; then
  log "installing schemathesis $SCHEMATHESIS_VERSION into $VENV"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$SCHEMATHESIS_VERSION"
fi

# --- binary ------------------------------------------------------------------------------------------
# `cargo test --no-run` builds target/debug/cifpool with the same profile ([profile.test], opt-level 1)
# and dev-dependency features as CI's `cargo test`, so it is a no-op after that step; a plain
# `cargo build` would use the dev profile (opt-level 0) and recompile the whole dependency tree.
log "building $BIN"
cargo test --quiet --no-run --test it
[ -x "$BIN" ] || { log "no $BIN after the build"; exit 1; }

# --- server ------------------------------------------------------------------------------------------
work=$(mktemp -d -t cifpool-fuzz.XXXXXX)
# As root the embedded Postgres runs as the `postgres` user, which must reach $work/pg.
chmod 755 "$work"
server_pid=
provider_pid=
stop() { # stop PID NAME: SIGINT, then SIGKILL if it is still running after 30 s
  local pid=$1
  if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then return 0; fi
  log "stopping $2 (SIGINT)"
  kill -INT "$pid" 2>/dev/null || true
  for _ in $(seq 1 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "$2 still running after 30 s: SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" 2>/dev/null || true
}
cleanup() {
  stop "$server_pid" "the server"
  stop "$provider_pid" "the fake provider"
  # The embedded Postgres stops when cifpool does (its guard watches a pipe); give it a moment.
  for _ in $(seq 1 100); do [ -e "$work/pg/postmaster.pid" ] || break; sleep 0.1; done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
provider_port=$(free_port)
token=$(python3 -c 'import secrets; print(secrets.token_hex(16))') # 32 characters
base="http://127.0.0.1:$port"

# The `push` provider (class promo) is a fake that rejects everything (HTTP 422, a permanent failure), so
# promo jobs become dead letters and /admin/dlq and /admin/dlq/replay are fuzzed with rows to list and
# replay. `sms` (otp, transactional) stays the default noop provider.
"$BIN" fake-provider --listen "127.0.0.1:$provider_port" --latency-ms 1 --reject-rate 1 >"$work/provider.log" 2>&1 &
provider_pid=$!
printf '[queue.providers.push]\nkind = "http"\nurl = "http://127.0.0.1:%s"\ntimeout = "2s"\n' "$provider_port" \
  >"$work/fuzz.toml"
printf 'max_concurrency = 800\nmin_concurrency = 4\n' >>"$work/fuzz.toml"

log "starting cifpool serve on $base (data in $work)"
# Every request comes from this one address, and the fuzzer sends refused credentials to every
# operation on purpose: with the per-address budget of failed authentications on, those checks would
# get 429 instead of the 401 they test. The budget has its own tests (tests/it/auth.rs, tests/it/console.rs).
CIFPOOL_SECURITY__FAILED_AUTH_PER_MINUTE=0 \
  CIFPOOL_SECURITY__ADMIN_TOKEN=$token \
  CIFPOOL_MASTER_KEY=$(python3 -c 'import secrets; print(secrets.token_hex(32))') \
  "$BIN" --config "$work/fuzz.toml" --data-dir "$work/pg" serve --listen "127.0.0.1:$port" \
  >"$work/server.log" 2>&1 &
server_pid=$!

ready=0
for _ in $(seq 1 600); do
  if curl -fsS -o /dev/null --max-time 2 "$base/readyz" 2>/dev/null; then
    ready=1
    break
  fi
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.1
done
if [ "$ready" != 1 ]; then
  log "the server did not become ready within 60 s; its log:"
  cat "$work/server.log" >&2
  exit 1
fi

# An API key with every scope for the run, made with the bootstrap admin token. Its name is random, so a
# generated DELETE /admin/keys/{name} cannot revoke it halfway through.
key_name="fuzz-$(python3 -c 'import secrets; print(secrets.token_hex(12))')"
api_key=$(curl -fsS -H "Authorization: Bearer $token" -H 'Content-Type: application/json' \
  -d "{\"name\":\"$key_name\",\"scopes\":[\"cif:reserve\",\"cif:read\",\"notify:send\",\"notify:read\",\"admin\"]}" \
  "$base/admin/keys" | python3 -c 'import json, sys; print(json.load(sys.stdin)["key"])')
[ -n "$api_key" ] || { log "could not create the fuzzing API key"; exit 1; }

# Seed dead letters (a replay needs at least two matching jobs to spread them over time).
for i in 1 2 3 4; do
  curl -fsS -o /dev/null -H 'Content-Type: application/json' -H "Authorization: Bearer $api_key" \
    -d "{\"class\":\"promo\",\"tenant\":\"fuzz\",\"recipient\":\"device-$i\",\"payload\":{\"n\":$i}}" \
    "$base/v1/notifications"
done
dead=0
for _ in $(seq 1 150); do
  dead=$(curl -fsS -H "Authorization: Bearer $token" "$base/admin/dlq" |
    python3 -c 'import json, sys; print(len(json.load(sys.stdin)["jobs"]))')
  [ "$dead" -ge 4 ] && break
  sleep 0.1
done
if [ "$dead" -lt 4 ]; then
  log "expected 4 dead letters, found $dead; server log:"
  cat "$work/server.log" >&2
  exit 1
fi
log "ready; $dead dead letters seeded"

# --- schemathesis ------------------------------------------------------------------------------------
# Every check schemathesis has runs (no 5xx; documented status, content type, headers and body schema;
# schema-violating requests rejected; auth not ignored; 405 for undocumented methods; ...), except:
#   positive_data_acceptance - wants a 2xx for every schema-valid request, which cannot hold here: the
#       Cif schema can only say `^[0-9]+$` (length, prefix and check digit are beyond a pattern), so a
#       random code is 400 (malformed) or 404 (never issued); a random UUID holds no reservation (409);
#       pool and class names are configuration (404/422 for random ones); a batch whose jobs and defaults
#       both lack a tenant is 422; and some 4xx depend on earlier calls (an Idempotency-Key reused for
#       another customer_type is 422). The schemas cannot express any of these.
# scripts/schemathesis.toml adds 413 to the statuses that count as refusing a schema-violating request.
checks=${FUZZ_CHECKS:-all}
exclude=${FUZZ_EXCLUDE_CHECKS:-positive_data_acceptance}

log "schemathesis $SCHEMATHESIS_VERSION: seed $SEED, at most $MAX_EXAMPLES examples per operation"
status=0
# One worker: with several, schemathesis's threads trip CPython 3.11.7's "AST constructor recursion
# depth mismatch" bug (hypothesis parses lambda sources) and the run reports spurious errors.
# It runs in target/fuzz-state, where it keeps its crash cache (.schemathesis: earlier failures are
# retried first) and hypothesis its data (.hypothesis), out of the work tree.
mkdir -p target/fuzz-state
report_dir=${FUZZ_REPORT_DIR:+$(realpath -m "$FUZZ_REPORT_DIR")}
# A hung run must not hold CI until its own time limit: FUZZ_TIMEOUT bounds it (coreutils `timeout`).
(cd target/fuzz-state && exec timeout "${FUZZ_TIMEOUT:-20m}" "$root/$VENV/bin/schemathesis" \
  --config-file "$root/scripts/schemathesis.toml" run "$root/openapi.yaml" \
  --url "$base" \
  --header "Authorization: Bearer $api_key" \
  --checks "$checks" \
  --exclude-checks "$exclude" \
  --max-examples "$MAX_EXAMPLES" \
  --seed "$SEED" \
  --workers 1 \
  --request-timeout 15 \
  --generation-database none \
  --no-color \
  --warnings off \
  ${report_dir:+--report har,ndjson --report-dir "$report_dir"} \
  ${FUZZ_ARGS:-}) ||
  status=$?

# A panic or an ERROR line is a failure even when every answer looked right: a task that died behind
# a 200, or a 5xx that schemathesis did not get to see.
errors=$(sed 's/\x1b\[[0-9;]*m//g' "$work/server.log" | grep -E 'panicked| ERROR ' || true)
if [ -n "$errors" ]; then
  log "the server logged $(printf '%s\n' "$errors" | wc -l) panics or errors (last 40):"
  printf '%s\n' "$errors" | tail -n 40 >&2
  [ "$status" != 0 ] || status=1
fi
if [ "$status" != 0 ]; then
  log "FAILED (schemathesis exit $status); rerun with FUZZ_SEED=$SEED to reproduce"
  exit 1
fi
log "passed"
