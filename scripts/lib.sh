# Shared by scripts/run, scripts/test and scripts/bench: installing what is
# missing and starting a private redis-server. Source it; do not run it.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STATE="$ROOT/.redis"          # git-ignored: private Redis data, pid and log

say() { printf 'floodgate: %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else say "need root to run: $*"; return 1; fi
}

APT_UPDATED=""
# apt_install PKG...: installs the Debian packages that are missing.
apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "installing ${missing[*]}"
  if [ -z "$APT_UPDATED" ]; then
    as_root apt-get update -qq
    APT_UPDATED=1
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
}

# apt_unpack PKG DIR: unpacks the Debian package PKG into DIR without
# installing it (nothing is configured or started): for a tool the tests run.
apt_unpack() {
  local pkg="$1" dir="$2" tmp
  if [ -z "${APT_UPDATED:-}" ]; then
    as_root apt-get update -qq
    APT_UPDATED=1
  fi
  tmp="$(mktemp -d)"
  chmod a+rwx "$tmp" # (apt downloads as its own user)
  (cd "$tmp" && apt-get download -qq "$pkg" >/dev/null)
  mkdir -p "$dir"
  dpkg-deb -x "$tmp"/"$pkg"_*.deb "$dir"
  rm -rf "$tmp"
}

ensure_redis_server() {
  command -v redis-server >/dev/null && command -v redis-cli >/dev/null || apt_install redis-server
}

# redis_reachable URL: true when a Redis answers PING there.
redis_reachable() {
  command -v redis-cli >/dev/null || return 1
  [ "$(timeout 2 redis-cli -u "$1" ping 2>/dev/null)" = "PONG" ]
}

# free_port: a TCP port on 127.0.0.1 that nothing listens on.
free_port() {
  if command -v python3 >/dev/null; then
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
    return
  fi
  local p
  for _ in $(seq 1 100); do
    p=$((20000 + RANDOM % 40000))
    (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
  done
  say "no free port found"; return 1
}

# start_private_redis: starts a redis-server on a free port under .redis/
# (no persistence) and prints its URL. stop_private_redis stops it.
start_private_redis() {
  ensure_redis_server
  mkdir -p "$STATE"
  local port; port="$(free_port)"
  redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$STATE" --pidfile "$STATE/redis-$port.pid" --logfile "$STATE/redis-$port.log" \
    --daemonize yes >/dev/null
  local url="redis://127.0.0.1:$port/0"
  for _ in $(seq 1 100); do
    redis_reachable "$url" && { PRIVATE_REDIS_PID_FILE="$STATE/redis-$port.pid"; echo "$url"; return 0; }
    sleep 0.05
  done
  say "redis-server did not start; see $STATE/redis-$port.log"
  return 1
}

stop_private_redis() {
  local f="${PRIVATE_REDIS_PID_FILE:-}"
  [ -n "$f" ] && [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
}

# cluster_port: a free port P with P + 10000 (the cluster bus) free too.
cluster_port() {
  local p
  for _ in $(seq 1 200); do
    p="$(free_port)"
    if [ "$p" -lt 55000 ] && ! (exec 3<>"/dev/tcp/127.0.0.1/$((p + 10000))") 2>/dev/null; then
      echo "$p"; return 0
    fi
  done
  say "no free port P with P + 10000 free too"; return 1
}

# start_private_cluster DIR N: starts N cluster-enabled redis-servers on
# 127.0.0.1 (no persistence, each in DIR/PORT with its pid, log and node
# file), joins them as N masters without replicas, waits until every node
# reports cluster_state:ok and prints their ports, space-separated.
# stop_private_cluster DIR stops them and removes DIR: set the trap before
# starting, so a start that fails half-way is cleaned up too.
start_private_cluster() {
  local dir="$1" n="$2" ports=() p
  ensure_redis_server
  mkdir -p "$dir"
  for _ in $(seq 1 "$n"); do
    p="$(cluster_port)"
    mkdir -p "$dir/$p"
    redis-server --port "$p" --bind 127.0.0.1 --save '' --appendonly no \
      --cluster-enabled yes --cluster-config-file nodes.conf \
      --dir "$dir/$p" --pidfile "$dir/$p/redis.pid" --logfile "$dir/$p/redis.log" \
      --daemonize yes >/dev/null
    ports+=("$p")
    # Listening before the next port is chosen, so no two nodes pick one.
    local up=""
    for _ in $(seq 1 100); do
      redis_reachable "redis://127.0.0.1:$p" && { up=1; break; }
      sleep 0.05
    done
    [ -n "$up" ] || { say "cluster node $p did not start; see $dir/$p/redis.log"; return 1; }
  done
  if ! redis-cli --cluster create $(printf '127.0.0.1:%s ' "${ports[@]}") \
      --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1; then
    say "redis-cli --cluster create failed; see $dir/create.log"; return 1
  fi
  local ok
  for _ in $(seq 1 200); do
    ok=1
    for p in "${ports[@]}"; do
      redis-cli -p "$p" cluster info 2>/dev/null | grep -q '^cluster_state:ok' || { ok=""; break; }
    done
    [ -n "$ok" ] && { echo "${ports[*]}"; return 0; }
    sleep 0.05
  done
  say "the cluster did not reach cluster_state:ok on every node; see $dir"
  return 1
}

stop_private_cluster() {
  local dir="${1:-}" f p
  [ -n "$dir" ] && [ -d "$dir" ] || return 0
  local pids=()
  for f in "$dir"/*/redis.pid; do
    [ -f "$f" ] && pids+=("$(cat "$f")")
  done
  [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true
  # Gone before the directory is (at most 5 s; they keep no data).
  for _ in $(seq 1 100); do
    local alive=""
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ -z "$alive" ] && break
    sleep 0.05
  done
  rm -rf "$dir"
}
