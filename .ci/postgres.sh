#!/usr/bin/env bash
# Install (Debian package) and start a local PostgreSQL server on 127.0.0.1 for the store's Postgres tests,
# then print its SQLAlchemy URL on stdout (everything else goes to stderr). No stdin; safe to re-run.
#   export ETHEN_TEST_PG_URL="$(bash .ci/postgres.sh)"
set -euo pipefail
PORT="${ETHEN_PG_PORT:-54329}"
DB=ethen_test
USER_=ethen
PASS=ethen-test-pw
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo -n"
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -q >&2
    $SUDO apt-get install -y -q --no-install-recommends postgresql >&2
fi
BIN="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)"
DATA="${ETHEN_PG_DATA:-/tmp/ethen-pg-$PORT}"
RUN=(bash -c)
if [ "$(id -u)" = 0 ]; then
    # initdb refuses to run as root: run the server as the 'postgres' system user the package created.
    RUN=(su postgres -s /bin/bash -c)
    mkdir -p "$DATA" && chown postgres "$DATA"
fi
if [ ! -f "$DATA/PG_VERSION" ]; then
    "${RUN[@]}" "'$BIN/initdb' -D '$DATA' -A trust -U postgres >/dev/null" >&2
fi
if ! "${RUN[@]}" "'$BIN/pg_ctl' -D '$DATA' status" >/dev/null 2>&1; then
    "${RUN[@]}" "'$BIN/pg_ctl' -D '$DATA' -l '$DATA/server.log' -w -t 60 \
        -o \"-c listen_addresses=127.0.0.1 -p $PORT -c unix_socket_directories='$DATA'\" start" >&2
fi
PSQL=("$BIN/psql" -h 127.0.0.1 -p "$PORT" -U postgres -v ON_ERROR_STOP=1 -qtA)
"${PSQL[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname='$USER_'" | grep -q 1 \
    || "${PSQL[@]}" -c "CREATE ROLE $USER_ LOGIN PASSWORD '$PASS'" >&2
# CREATEDB: each test creates (and drops) its own database, so concurrent test runs cannot collide.
"${PSQL[@]}" -c "ALTER ROLE $USER_ CREATEDB" >&2
"${PSQL[@]}" -c "SELECT 1 FROM pg_database WHERE datname='$DB'" | grep -q 1 \
    || "${PSQL[@]}" -c "CREATE DATABASE $DB OWNER $USER_" >&2
echo "postgresql://$USER_:$PASS@127.0.0.1:$PORT/$DB"
