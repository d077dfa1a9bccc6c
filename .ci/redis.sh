#!/usr/bin/env bash
# Install (Debian package) and start a local Redis server on 127.0.0.1 for the tests of several gateway
# instances (shared telemetry, rate limits), then print its URL on stdout (everything else goes to stderr).
# No stdin; safe to re-run (a server already answering on the port is reused).
#   export ETHEN_TEST_REDIS_URL="$(bash .ci/redis.sh)"
set -euo pipefail
PORT="${ETHEN_REDIS_PORT:-63799}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
if ! command -v redis-server >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >&2
    $SUDO apt-get install -y -q --no-install-recommends redis-server >&2
fi
DATA="${ETHEN_REDIS_DATA:-/tmp/ethen-redis-$PORT}"
mkdir -p "$DATA"
if ! redis-cli -h 127.0.0.1 -p "$PORT" ping >/dev/null 2>&1; then
    # no persistence: the tests' state is per run; the server stays up for later runs (like .ci/postgres.sh)
    redis-server --bind 127.0.0.1 --port "$PORT" --daemonize yes --dir "$DATA" --save "" --appendonly no \
        --logfile "$DATA/server.log" --pidfile "$DATA/redis.pid" >&2
    for _ in $(seq 1 100); do
        redis-cli -h 127.0.0.1 -p "$PORT" ping >/dev/null 2>&1 && break
        sleep 0.1
    done
    redis-cli -h 127.0.0.1 -p "$PORT" ping >/dev/null
fi
echo "redis://127.0.0.1:$PORT/0"
