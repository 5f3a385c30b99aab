# Source me (bash): installs Debian's PostgreSQL if missing, starts a throwaway server as
# the postgres user in a temp dir on a free loopback port, creates a test database and
# exports CODEBUDDY2API_TEST_DATABASE_URL. `pg_stop` stops it and removes the directory.
# Used by .ci/run; locally: `source .ci/postgres.sh` (then `pg_stop` when done).

if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    PG_SUDO=""; [ "$(id -u)" -eq 0 ] || PG_SUDO="sudo"
    $PG_SUDO apt-get update -qq
    $PG_SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
PG_BIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
PG_DIR=$(mktemp -d /tmp/cb2a-pg.XXXXXX)
PG_PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
if [ "$(id -u)" = 0 ]; then
    chown postgres "$PG_DIR"
    pg_as() { (cd / && runuser -u postgres -- "$@"); }  # postgres refuses to run as root
else
    pg_as() { "$@"; }
fi
pg_as "$PG_BIN/initdb" -D "$PG_DIR/data" -U postgres -A trust --no-sync >/dev/null
pg_as "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 \
    -o "-p $PG_PORT -k $PG_DIR -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" start >/dev/null
pg_as "$PG_BIN/psql" -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -v ON_ERROR_STOP=1 \
    -c "CREATE ROLE cb2a LOGIN PASSWORD 'cb2a'" -c "CREATE DATABASE cb2a_test OWNER cb2a" >/dev/null
export CODEBUDDY2API_TEST_DATABASE_URL="postgresql://cb2a:cb2a@127.0.0.1:$PG_PORT/cb2a_test"
pg_stop() {
    pg_as "$PG_BIN/pg_ctl" -D "$PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$PG_DIR"
}
echo "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$PG_PORT (data in $PG_DIR)"
