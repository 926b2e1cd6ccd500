#!/usr/bin/env python3
"""The measuring half of scripts/bench (run that, not this: it builds the
binaries and starts the Redis this expects).

Every case starts its server afresh on a free 127.0.0.1 port, checks one
request by hand (and, for the denied cases, uses up the tiny limit), warms
up with wrk, resets Redis's statistics, measures with wrk, then reads
Redis's `INFO commandstats` / `INFO cpu` (and, for one sliding rule, the
SLOWLOG: the longest single call), floodgate's /metrics and the server's
VmRSS, and stops it. Two cases measure under stress: a denied flood over
100000 distinct keys (VmRSS before and after: the denial cache is bounded),
and a stalled Redis (CLIENT PAUSE for the whole run: what a decision takes
while the breaker answers; and, with a second wrk on an unguarded route
beside the guarded traffic, what the stall costs the requests that never
needed Redis). Three cases compare one sliding rule on a
3-master Redis Cluster (started by scripts/bench) with the same rule on the
single server: keyed by address (one hot key) and keyed by a header that
wrk cycles over 1000 identities; for them every master's statistics are
read and summed, and each master's share of the decision calls (FCALL) and
Redis's reads per call are reported. The cases run in one order, then reversed,
round after round; medians are reported, ratios are medians of the ratios
within each round. After each round, `reference_async cost` measures what
one decision costs Redis for every algorithm at limits 10, 100000 and 10^9,
beside the plain sliding-log script in benches/floor_sliding_log.lua.
"""

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SECONDS = int(os.environ.get("BENCH_SECONDS", "5"))
WARMUP = int(os.environ.get("BENCH_WARMUP", "1"))
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "64"))
WORKERS = int(os.environ.get("BENCH_WORKERS", str(os.cpu_count() or 2)))
COST_CALLS = int(os.environ.get("BENCH_COST_CALLS", "20000"))
# A comma-separated list of case keys: only those run, without the cost
# probe, and only their per-round figures are printed (no table, no file).
ONLY = [c for c in os.environ.get("BENCH_CASES", "").split(",") if c]
# With BENCH_CASES: another floodgate binary, run beside this tree's in
# every round (alternating which goes first), and the ratio other/this.
OTHER = os.environ.get("BENCH_OTHER_FLOODGATE")
# With it: the other build's axum example too (else the axum cases run this
# tree's in both places).
OTHER_AXUM = os.environ.get("BENCH_OTHER_AXUM")

# Limits that always allow at any rate this machine reaches (well under
# 100000 requests per second), and one that always denies once used.
ALLOW = {"limit": 100000, "window": "1s"}
HEADER = "X-Bench-Client"
KEY_HEADER = "X-Bench-Key"
DISTINCT_KEYS = 100000
# The spread cases: one rule keyed by this header, wrk cycling over this
# many identities (so a cluster's keys fall on every master).
SPREAD_HEADER = "X-Bench-Id"
SPREAD_IDS = 1000
# The cases served by the private Redis Cluster instead of the single server.
CLUSTER_CASES = ("cluster", "cluster_spread")
# The stalled case: floodgate's Redis timeout, and how long Redis is paused
# (longer than the measured run, so every decision falls in the stall).
STALL_TIMEOUT_MS = 250
# The cases measured while Redis is paused.
STALL_CASES = ("stalled", "stalled_side")
# Case 8b: the guarded route, and the unguarded one a second wrk times
# meanwhile on these many connections.
SIDE_GUARDED = "/api/ping"
SIDE_UNGUARDED = "/healthz"
SIDE_CONNECTIONS = 4



# The commands that carry decisions: floodgate's batch function, or its
# script where Redis refuses functions.
DECISION_CMDS = ("fcall", "evalsha")


def decision_calls(stats):
    """Decision calls in one server's `INFO commandstats` (parsed)."""
    return int(sum(stats.get(k, {}).get("calls", 0) for k in DECISION_CMDS))

def window_rule(name, **extra):
    rule = {"name": name, "paths": ["/healthz"], "key": "ip", **ALLOW}
    rule.update(extra)
    return rule


CASES = [
    # key, label, server, rules, path, expect
    ("unguarded", "1. GET /healthz, no rule", "floodgate", [], "/healthz", "allow"),
    ("sliding", "2. one sliding_window rule", "floodgate", [window_rule("sw")], "/healthz", "allow"),
    (
        "denied_status",
        "3a. every request denied, deny=status",
        "floodgate",
        [window_rule("deny", limit=1, window="1h", deny="status")],
        "/healthz",
        "deny",
    ),
    (
        "denied_redirect",
        "3b. every request denied, deny=redirect",
        "floodgate",
        [window_rule("deny", limit=1, window="1h", deny="redirect")],
        "/healthz",
        "deny",
    ),
    (
        "sliding_threads",
        "2t. one sliding_window rule, dispatcher threads",
        "floodgate",
        [window_rule("sw")],
        "/healthz",
        "allow",
    ),
    (
        "two_rules",
        "4. two rules: ip + header",
        "floodgate",
        [window_rule("by_ip"), window_rule("by_header", key=f"header:{HEADER}")],
        "/healthz",
        "allow",
    ),
    (
        "fixed",
        "5a. one fixed_window rule",
        "floodgate",
        [window_rule("fw", algorithm="fixed_window")],
        "/healthz",
        "allow",
    ),
    (
        "token",
        "5b. one token_bucket rule",
        "floodgate",
        [
            {
                "name": "tb",
                "paths": ["/healthz"],
                "key": "ip",
                "algorithm": "token_bucket",
                "rate": 1000000.0,
                "burst": 100000,
            }
        ],
        "/healthz",
        "allow",
    ),
    (
        "gcra",
        "5c. one gcra rule",
        "floodgate",
        [window_rule("gc", algorithm="gcra")],
        "/healthz",
        "allow",
    ),
    (
        "sliding_counter",
        "5d. one sliding_counter rule",
        "floodgate",
        [window_rule("sc", algorithm="sliding_counter")],
        "/healthz",
        "allow",
    ),
    (
        "denied_many",
        f"3c. denied flood over {DISTINCT_KEYS} keys",
        "floodgate",
        [window_rule("many", key=f"header:{KEY_HEADER}", limit=1, window="1h", deny="status")],
        "/healthz",
        "mixed",
    ),
    ("axum_unguarded", "10a. axum 0.8 (the library's example), GET /healthz, no rule", "axum", [],
     "/healthz", "allow"),
    ("axum_sliding", "10b. axum 0.8 behind the tower layer, one sliding_window rule", "axum",
     [window_rule("sw")], "/healthz", "allow"),
    ("actix_limitation", "6. actix-limitation 0.6 (peer)", "peer", None, "/check", "allow"),
    ("reference", "7. async reference (multiplexed)", "reference", None, "/check", "allow"),
    (
        "sliding_spread",
        f"2s. one sliding_window rule, header key over {SPREAD_IDS} identities",
        "floodgate",
        [window_rule("sw", key=f"header:{SPREAD_HEADER}")],
        "/healthz",
        "allow",
    ),
    (
        "cluster_spread",
        f"9b. one sliding_window rule on a 3-master cluster, header key over {SPREAD_IDS} identities",
        "floodgate",
        [window_rule("sw", key=f"header:{SPREAD_HEADER}")],
        "/healthz",
        "allow",
    ),
    (
        "cluster",
        "9a. one sliding_window rule on a 3-master cluster, ip key (one hot key)",
        "floodgate",
        [window_rule("sw")],
        "/healthz",
        "allow",
    ),
    (
        "stalled",
        "8. Redis stalled (CLIENT PAUSE), on_redis_error = allow",
        "floodgate",
        [window_rule("stall", on_redis_error="allow")],
        "/healthz",
        "stall",
    ),
    (
        "stalled_side",
        "8b. Redis stalled (CLIENT PAUSE): an unguarded route's latency beside guarded traffic",
        "floodgate",
        [{"name": "side", "paths": [SIDE_GUARDED], "key": "ip", **ALLOW, "on_redis_error": "allow"}],
        SIDE_GUARDED,
        "stall",
    ),
]


def log(msg):
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def toml_value(v):
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def floodgate_config(rules, redis_timeout_ms=None, cluster=None):
    lines = [
        "# Written by scripts/bench for one case; FLOODGATE_BIND and",
        "# FLOODGATE_REDIS_URL say where (a cluster's seeds, when set, win).",
        "[server]",
        f"workers = {WORKERS}",
    ]
    redis = []
    if redis_timeout_ms:
        redis.append(f'timeout = "{redis_timeout_ms}ms"')
    if cluster:
        redis.append(f"cluster = {toml_value(cluster)}")
    if redis:
        lines += ["[redis]", *redis]
    lines += [
        "[defaults]",
        'deny = "status"  # an unexpected denial shows as a non-2xx',
    ]
    for r in rules:
        lines.append("[[rule]]")
        for k, v in r.items():
            lines.append(f"{k} = {toml_value(v)}")
    return "\n".join(lines) + "\n"


class Redis:
    def __init__(self, url):
        self.url = url

    def cli(self, *args):
        out = subprocess.run(
            ["redis-cli", "-u", self.url, *args],
            check=True,
            capture_output=True,
            text=True,
        )
        return out.stdout

    def info(self, section):
        fields = {}
        for line in self.cli("INFO", section).splitlines():
            if ":" in line and not line.startswith("#"):
                k, v = line.strip().split(":", 1)
                fields[k] = v
        return fields

    def cpu_seconds(self):
        i = self.info("cpu")
        return float(i["used_cpu_user"]) + float(i["used_cpu_sys"])

    def nodes(self):
        return [self]

    def reads(self):
        """How many reads from its clients' sockets Redis has made."""
        return int(self.info("stats")["total_reads_processed"])

    def slowlog_script_usec(self):
        """How long each script call in the SLOWLOG took (microseconds),
        read over RESP."""
        host, port = self.url.split("//", 1)[1].split("/", 1)[0].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"*3\r\n$7\r\nSLOWLOG\r\n$3\r\nGET\r\n$2\r\n-1\r\n")
            f = s.makefile("rb")
            entries = read_resp(f)
        return [e[2] for e in entries
                if e[3] and str(e[3][0], "utf-8", "replace").upper() in ("FCALL", "EVALSHA")]

    def commandstats(self):
        stats = {}
        for k, v in self.info("commandstats").items():
            name = k[len("cmdstat_"):]
            stats[name] = {kv.split("=")[0]: float(kv.split("=")[1]) for kv in v.split(",")}
        return stats


class Cluster:
    """The masters of the private Redis Cluster, read like one server:
    commands go to every master, CPU time and command statistics are summed."""

    def __init__(self, urls):
        self.masters = [Redis(u) for u in urls]
        self.urls = urls

    def cli(self, *args):
        return [m.cli(*args) for m in self.masters]

    def nodes(self):
        return self.masters

    def cpu_seconds(self):
        return sum(m.cpu_seconds() for m in self.masters)

    def commandstats(self):
        total = {}
        for m in self.masters:
            for name, fields in m.commandstats().items():
                t = total.setdefault(name, {})
                for k, v in fields.items():
                    t[k] = t.get(k, 0.0) + v
        for t in total.values():
            if "usec" in t and "calls" in t:
                t["usec_per_call"] = t["usec"] / max(t["calls"], 1)
        return total


def read_resp(f):
    """One RESP value from a binary file object."""
    line = f.readline().rstrip(b"\r\n")
    kind, rest = line[:1], line[1:]
    if kind == b"*":
        n = int(rest)
        return [read_resp(f) for _ in range(max(n, 0))]
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)[:n]
        return data
    if kind in (b"+", b"-"):
        return rest
    raise ValueError(f"unexpected RESP {line!r}")


def wait_port(port, proc, seconds=15):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def get(port, path, headers=None):
    """One GET, no redirect following: (status, headers)."""
    deadline = time.time() + 10
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path, headers=headers or {})
            r = c.getresponse()
            r.read()
            c.close()
            return r.status, dict(r.getheaders())
        except (ConnectionError, http.client.HTTPException):
            # The listener is up before every worker (and its Redis
            # connection) is: retry briefly.
            if time.time() > deadline:
                raise
            time.sleep(0.1)


UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def parse_wrk(text):
    def ms(v):
        m = re.match(r"([\d.]+)(us|ms|s)$", v)
        return float(m.group(1)) * UNITS[m.group(2)]

    out = {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1)),
        "requests": int(re.search(r"(\d+) requests in", text).group(1)),
        "p50": ms(re.search(r"^\s+50%\s+(\S+)", text, re.M).group(1)),
        "p99": ms(re.search(r"^\s+99%\s+(\S+)", text, re.M).group(1)),
        "non2xx": 0,
        "socket_errors": 0,
    }
    m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if m:
        out["non2xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        out["socket_errors"] = sum(int(x) for x in m.groups())
    return out


def machine_busy():
    """(busy, total) jiffies of every CPU so far, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def wrk_cmd(port, path, seconds, lua=None, latency=False, connections=CONNECTIONS):
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s"]
    if latency:
        cmd.append("--latency")
    if lua:
        cmd += ["-s", lua]
    cmd.append(f"http://127.0.0.1:{port}{path}")
    return cmd


def wrk(port, path, seconds, lua=None, latency=False):
    cmd = wrk_cmd(port, path, seconds, lua, latency)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def vm_rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def cpu_seconds(pid):
    """User + system CPU time of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    counts = {}
    for m in re.finditer(r'floodgate_decisions_total\{rule="([^"]+)",decision="(\w+)"\} (\d+)', text):
        counts[m.group(2)] = counts.get(m.group(2), 0) + int(m.group(3))
    errors = re.search(r"^floodgate_redis_errors_total (\d+)", text, re.M)
    counts["redis_errors"] = int(errors.group(1)) if errors else 0
    counts["cache_hits"] = sum(
        int(m.group(1)) for m in re.finditer(r"^floodgate_deny_cache_hits_total\{[^}]*\} (\d+)", text, re.M)
    )
    return counts


def settled_metrics(port):
    """The counters once they stop moving: wrk hangs up on the requests it
    still had in flight when its time ran out, and floodgate decides them a
    moment later; those must not be counted in the next measurement."""
    last = metrics(port)
    for _ in range(40):
        time.sleep(0.05)
        now = metrics(port)
        if now == last:
            return now
        last = now
    return last


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cycling_script(work, name, comment, header, prefix, count):
    """A wrk script that sends `header: PREFIX<i>`, i cycling over `count`."""
    lua = os.path.join(work, name)
    with open(lua, "w") as f:
        f.write(f'-- scripts/bench: {comment}\n'
                f'local i = 0\n'
                f'request = function()\n'
                f'  i = (i + 1) % {count}\n'
                f'  wrk.headers["{header}"] = "{prefix}" .. i\n'
                f'  return wrk.format(nil)\n'
                f'end\n')
    return lua


def run_case(case, redis, cluster, bins, work):
    key, label, server, rules, path, expect = case
    # Where this case's counts live: every statistic below is read there.
    store = cluster if key in CLUSTER_CASES else redis
    port = free_port()
    logf = open(os.path.join(work, f"{key}.log"), "w")
    if server == "axum":
        # The axum example serves /healthz behind one tower layer built
        # from the same kind of file (its tokio runtime takes every core).
        cfg = os.path.join(work, f"{key}.toml")
        with open(cfg, "w") as f:
            f.write(floodgate_config(rules))
        env = dict(os.environ, FLOODGATE_BIND=f"127.0.0.1:{port}", FLOODGATE_REDIS_URL=redis.url)
        cmd = [bins["axum"], cfg]
    elif server == "floodgate":
        cfg = os.path.join(work, f"{key}.toml")
        with open(cfg, "w") as f:
            f.write(floodgate_config(rules, STALL_TIMEOUT_MS if key in STALL_CASES else None,
                                     cluster.urls if key in CLUSTER_CASES else None))
        env = dict(
            os.environ,
            FLOODGATE_BIND=f"127.0.0.1:{port}",
            FLOODGATE_REDIS_URL=redis.url,
            RUST_LOG="info",
        )
        if key == "sliding_threads":
            env["FLOODGATE_DISPATCH"] = "threads"
        cmd = [bins["floodgate"], "serve", "--config", cfg]
    elif server == "peer":
        env = dict(os.environ, RUST_LOG="error")
        cmd = [bins["peer_actix_limitation"], "--port", str(port), "--redis", redis.url,
               "--workers", str(WORKERS), "--limit", "100000000", "--period-secs", "3600"]
    else:
        env = dict(os.environ, RUST_LOG="error")
        cmd = [bins["reference_async"], "serve", "--port", str(port), "--redis", redis.url,
               "--workers", str(WORKERS), "--limit", str(ALLOW["limit"]), "--window-ms", "1000"]
    store.cli("FLUSHALL")
    proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc)
        lua = None
        headers = {}
        if key == "two_rules":
            lua = os.path.join(work, "header.lua")
            with open(lua, "w") as f:
                f.write(f'-- scripts/bench: case 4 keys its second rule by this header\n'
                        f'wrk.headers["{HEADER}"] = "bench-client-1"\n')
            headers[HEADER] = "bench-client-1"
        if key in ("sliding_spread", "cluster_spread"):
            lua = cycling_script(work, "spread.lua", f"cases 2s and 9b cycle over {SPREAD_IDS} identities",
                                 SPREAD_HEADER, "id", SPREAD_IDS)
            headers[SPREAD_HEADER] = "id0"
        if key == "denied_many":
            lua = cycling_script(work, "keys.lua", f"case 3c cycles over {DISTINCT_KEYS} keys",
                                 KEY_HEADER, "k", DISTINCT_KEYS)
        status, hdrs = get(port, path, headers)
        if status != 200:
            raise RuntimeError(f"{key}: first request got {status}")
        if expect == "deny":
            status, hdrs = get(port, path, headers)
            want = 429 if key == "denied_status" else 303
            if status != want:
                raise RuntimeError(f"{key}: expected {want} once the limit is used, got {status}")
        elif rules != [] and server != "peer" and not any(k.lower() == "ratelimit" for k in hdrs):
            raise RuntimeError(f"{key}: an allowed response without RateLimit fields")
        rss_before = vm_rss_kib(proc.pid)
        wrk(port, path, WARMUP, lua)
        if key == "denied_many":
            # One run long enough to go over every key twice (each wrk run
            # starts again at the first key): every key is then allowed
            # once and denied once, and the measured run is all denials.
            rate = max(parse_wrk(wrk(port, path, 1, lua, latency=True))["rps"], 1000)
            wrk(port, path, int(2.5 * DISTINCT_KEYS / rate) + 2, lua)
        m_before = settled_metrics(port) if server == "floodgate" else {}
        store.cli("CONFIG", "RESETSTAT")
        if key == "sliding":
            redis.cli("CONFIG", "SET", "slowlog-log-slower-than", "0")
            redis.cli("CONFIG", "SET", "slowlog-max-len", "1000000")
            redis.cli("SLOWLOG", "RESET")
        reads0 = [n.reads() for n in store.nodes()]
        cpu0, app0 = store.cpu_seconds(), cpu_seconds(proc.pid)
        wrk0, busy0 = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy()
        if key in STALL_CASES:
            # Paused for well longer than the run (wrk on a busy machine
            # overruns its seconds): every decision is made in the stall.
            redis.cli("CLIENT", "PAUSE", str(SECONDS * 1000 + 2500), "ALL")
        side = None
        if key == "stalled_side":
            # The unguarded route, timed on a few connections of its own
            # while the guarded traffic runs: same workers, no rule.
            side = subprocess.Popen(
                wrk_cmd(port, SIDE_UNGUARDED, SECONDS, latency=True, connections=SIDE_CONNECTIONS),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        text = wrk(port, path, SECONDS, lua, latency=True)
        side_text = None
        if side is not None:
            side_text, side_err = side.communicate()
            if side.returncode != 0:
                raise RuntimeError(f"{key}: the unguarded wrk failed: {side_err}")
        # floodgate's counters at once, before Redis (still paused in the
        # stalled case) answers anything again.
        after = metrics(port) if server == "floodgate" else {}
        wrk1, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), machine_busy()
        cpu1, app1 = store.cpu_seconds(), cpu_seconds(proc.pid)
        reads1 = [n.reads() for n in store.nodes()]
        node_stats = [n.commandstats() for n in store.nodes()]
        stats = store.commandstats()
        r = parse_wrk(text)
        if side_text is not None:
            s_r = parse_wrk(side_text)
            r["side"] = s_r
            r["side_p50"], r["side_p99"] = s_r["p50"], s_r["p99"]
        r["rss_kib"] = vm_rss_kib(proc.pid)
        r["rss_before_kib"] = rss_before
        if key == "sliding":
            took = sorted(redis.slowlog_script_usec())
            r["slowlog_max_us"] = took[-1] if took else 0
            r["slowlog_p999_us"] = took[int(0.999 * (len(took) - 1))] if took else 0
            r["slowlog_over_2ms"] = sum(1 for t in took if t > 2000)
            r["slowlog_calls"] = len(took)
            redis.cli("CONFIG", "SET", "slowlog-log-slower-than", "10000")
            redis.cli("CONFIG", "SET", "slowlog-max-len", "128")
            redis.cli("SLOWLOG", "RESET")
        if server == "floodgate":
            # What the measured run alone counted.
            r["metrics"] = {k: v - m_before.get(k, 0) for k, v in after.items()}
    finally:
        stop(proc)
        logf.close()

    n = max(r["requests"], 1)
    r["commandstats"] = stats
    r["redis_cpu_us"] = (cpu1 - cpu0) * 1e6 / n
    r["wrk_cpu_us"] = (wrk1.ru_utime + wrk1.ru_stime - wrk0.ru_utime - wrk0.ru_stime) * 1e6 / n
    r["busy"] = (busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1)
    r["app_cpu_us"] = None if app0 is None or app1 is None else (app1 - app0) * 1e6 / n
    # The decisions are FCALL calls of the batch function (EVALSHA where
    # Redis refuses functions); a worker lane also writes an
    # `EVAL "return 0" 0` before each (its marker, see dispatch/single.rs):
    # its time is counted, not its calls.
    scripted = {k: v for k, v in stats.items() if k in ("fcall", "evalsha", "eval")}
    if scripted:
        r["evalsha_calls"] = decision_calls(stats)
        r["evalsha_usec_per_call"] = (sum(stats.get(k, {}).get("usec", 0.0) for k in DECISION_CMDS)
                                      / max(r["evalsha_calls"], 1))
        r["redis_cmd_us"] = sum(v["usec"] for v in scripted.values()) / n
        r["batch"] = n / max(r["evalsha_calls"], 1)
        # Per master: its decision calls, and how many socket reads brought
        # them (INFO stats; our own few INFO calls are counted too). Fewer
        # reads than calls means several calls arrived in one read: pipelined.
        calls = [decision_calls(ns) for ns in node_stats]
        r["evalsha_per_req"] = r["evalsha_calls"] / n
        r["reads_per_evalsha"] = sum(b - a for a, b in zip(reads0, reads1)) / max(r["evalsha_calls"], 1)
        r["master_shares"] = sorted(c / max(sum(calls), 1) for c in calls)
    elif rules == []:
        r["redis_cmd_us"] = None
    else:
        # No script: every command the limiter sent (the statistics of
        # our own INFO and CONFIG calls left out).
        mine = {k: v for k, v in stats.items() if not k.startswith(("info", "config"))}
        r["redis_cmd_us"] = sum(v["usec"] for v in mine.values()) / n

    # Was every response what the case says it is?
    problems = []
    if r["socket_errors"]:
        problems.append(f"{r['socket_errors']} socket errors")
    m = r.get("metrics", {})
    if expect == "stall":
        if r["non2xx"]:
            problems.append(f"{r['non2xx']} non-2xx")
        side_r = r.get("side")
        if side_r and (side_r["non2xx"] or side_r["socket_errors"]):
            problems.append(f"unguarded route: {side_r['non2xx']} non-2xx, "
                            f"{side_r['socket_errors']} socket errors")
        if not m.get("error_allowed") or m.get("allowed"):
            problems.append(f"metrics {m}")
    elif expect == "mixed":
        # Every key denied; the cache (bounded below the number of keys)
        # answers what it still holds, Redis the rest.
        if m.get("allowed") or m.get("redis_errors"):
            problems.append(f"metrics {m}")
        r["hit_share"] = m.get("cache_hits", 0) / max(r["requests"], 1)
    elif expect == "allow":
        if r["non2xx"]:
            problems.append(f"{r['non2xx']} non-2xx")
        if m.get("denied") or m.get("error_allowed") or m.get("redis_errors"):
            problems.append(f"metrics {m}")
    else:
        # One allowed request used the limit before the measurement.
        if m.get("allowed", 0) != 0 or m.get("redis_errors"):
            problems.append(f"metrics {m}")
        if m.get("denied", 0) < r["requests"]:
            problems.append(f"only {m.get('denied', 0)} denials for {r['requests']} requests")
        if not m.get("cache_hits"):
            problems.append("no denial answered from the denial cache")
        if key == "denied_status" and r["non2xx"] != r["requests"]:
            problems.append(f"{r['requests'] - r['non2xx']} not 429")
    r["problems"] = problems
    return r


# The limits the cost probe measures every algorithm at (the logs only up
# to 100000, the most they allow).
COST_LIMITS = (10, 100000, 1000000000)


def cost_probe(redis, bins, limit):
    """{subject: {figure: value}} from `reference_async cost` at one limit."""
    out = subprocess.run(
        [bins["reference_async"], "cost", "--redis", redis.url, "--limit", str(limit),
         "--calls", str(COST_CALLS)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    result = {}
    for line in out.splitlines():
        pairs = dict(kv.split("=", 1) for kv in line.split())
        subject = pairs.pop("subject")
        result[subject] = {k: (None if v == "-" else float(v)) for k, v in pairs.items()}
    return result


def executables(build_log):
    bins = {}
    for line in open(build_log):
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        kind, name = m["target"]["kind"], m["target"]["name"]
        if kind == ["bin"] and name == "floodgate":
            bins["floodgate"] = m["executable"]
        elif kind == ["bench"]:
            bins[name] = m["executable"]
        elif kind == ["example"] and name == "axum":
            bins["axum"] = m["executable"]
    for need in ("floodgate", "peer_actix_limitation", "reference_async", "axum"):
        if need not in bins:
            raise SystemExit(f"bench: the build did not produce {need}")
    return bins


def machine():
    model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1048576:.0f} GiB"
    version = lambda cmd: subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
    redis_v = re.search(r"v=(\S+)", version(["redis-server", "--version"]))
    wrk_v = version(["sh", "-c", "wrk -v 2>&1 | head -1"]).split(" [")[0]
    return {
        "cores": os.cpu_count(),
        "model": model,
        "memory": mem,
        "kernel": platform.release(),
        "redis": redis_v.group(1) if redis_v else "?",
        "wrk": wrk_v,
        "rustc": version(["rustc", "--version"]),
        "load": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--cluster", required=True,
                    help="the private cluster's master ports, comma-separated")
    ap.add_argument("--build-log", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--build-seconds", type=int, default=None)
    a = ap.parse_args()
    bins = executables(a.build_log)
    redis = Redis(a.redis)
    cluster = Cluster([f"redis://127.0.0.1:{p}" for p in a.cluster.split(",") if p])
    host = machine()
    started = time.time()
    log(f"{len(ONLY) or len(CASES)} cases x {ROUNDS} rounds, {WARMUP}s warm-up + {SECONDS}s each, "
        f"wrk -t1 -c{CONNECTIONS}, {WORKERS} workers")

    cases = [c for c in CASES if c[0] in ONLY] if ONLY else CASES
    unknown = set(ONLY) - {c[0] for c in CASES}
    if unknown:
        raise SystemExit(f"BENCH_CASES: no such case: {', '.join(sorted(unknown))}")
    runs = {c[0]: [] for c in CASES}
    costs = {limit: [] for limit in COST_LIMITS}
    for rnd in range(ROUNDS):
        order = cases if rnd % 2 == 0 else cases[::-1]
        for case in order:
            if ONLY and OTHER:
                other = dict(bins, floodgate=OTHER, **({"axum": OTHER_AXUM} if OTHER_AXUM else {}))
                mine, theirs = (("", bins), ("other ", other))
                for name, b in ((mine, theirs) if rnd % 2 == 0 else (theirs, mine)):
                    r = run_case(case, redis, cluster, b, a.work)
                    runs.setdefault(name + case[0], []).append(r)
                    log(f"round {rnd + 1} {name + case[0]:23} {r['rps']:9.0f} req/s  server "
                        f"{r['app_cpu_us']:.2f} µs  Redis {r['redis_cpu_us']:.2f} µs per request,"
                        f" machine {100 * r['busy']:.0f}% busy")
                continue
            r = run_case(case, redis, cluster, bins, a.work)
            runs[case[0]].append(r)
            log(f"round {rnd + 1} {case[0]:17} {r['rps']:9.0f} req/s  p50 {r['p50']:.2f} ms  "
                f"p99 {r['p99']:.2f} ms" + (f"  PROBLEM: {r['problems']}" if r["problems"] else ""))
            if "reads_per_evalsha" in r:
                log(f"round {rnd + 1} {case[0]:17} FCALL/request {r['evalsha_per_req']:.3f}  "
                    f"reads/FCALL {r['reads_per_evalsha']:.2f}  masters' shares "
                    + " ".join(f"{x:.2f}" for x in r["master_shares"]))
        for limit in ([] if ONLY else COST_LIMITS if rnd % 2 == 0 else COST_LIMITS[::-1]):
            c = cost_probe(redis, bins, limit)
            costs[limit].append(c)
            for subject, f in c.items():
                log(f"round {rnd + 1} cost at limit {limit} {subject:16} one {f['one_usec']:.2f}  "
                    f"batch {f['batch_usec']:.2f}  spread {f['spread_usec']:.2f} µs/decision")
    elapsed = time.time() - started
    if ONLY and OTHER:
        for key in ONLY:
            mine, theirs = runs[key], runs["other " + key]
            log(f"{key:17} other/this: {med([b['rps'] / a['rps'] for a, b in zip(mine, theirs)]):.3f}"
                f" req/s ({med([a['rps'] for a in mine]):.0f} / {med([b['rps'] for b in theirs]):.0f}),"
                f" server µs/request {med([a['app_cpu_us'] for a in mine]):.2f} / "
                f"{med([b['app_cpu_us'] for b in theirs]):.2f}, Redis µs/request "
                f"{med([a['redis_cpu_us'] for a in mine]):.2f} / "
                f"{med([b['redis_cpu_us'] for b in theirs]):.2f}")
        return
    if ONLY:
        for key in ONLY:
            rs = runs[key]
            log(f"{key:17} median {med([r['rps'] for r in rs]):9.0f} req/s  server "
                f"{med([r['app_cpu_us'] for r in rs]):.2f} µs/request  Redis "
                f"{med([r['redis_cpu_us'] for r in rs]):.2f} µs/request")
            last = rs[-1]
            n = max(last["requests"], 1)
            for cmd, v in sorted(last["commandstats"].items(), key=lambda kv: -kv[1]["usec"])[:8]:
                log(f"{key:17}   {cmd:10} {v['calls'] / n:7.3f} calls  {v['usec'] / n:6.2f} µs"
                    " per request (last round)")
        return

    # Ratios within each round, then their median.
    def ratio(a_key, b_key, field="rps"):
        return med([x[field] / y[field] for x, y in zip(runs[a_key], runs[b_key])])

    rows = []
    for key, label, server, rules, path, expect in CASES:
        rs = runs[key]
        problems = sorted({p for r in rs for p in r["problems"]})
        expected_non2xx = expect == "deny" and key == "denied_status"
        rows.append({
            "key": key,
            "label": label,
            "rps": med([r["rps"] for r in rs]),
            "p50": med([r["p50"] for r in rs]),
            "p99": med([r["p99"] for r in rs]),
            "non2xx": sum(r["non2xx"] for r in rs),
            "requests": sum(r["requests"] for r in rs),
            "expected_non2xx": expected_non2xx,
            "cmd_us": med([r["redis_cmd_us"] for r in rs]),
            "cpu_us": None if rules == [] else med([r["redis_cpu_us"] for r in rs]),
            "app_us": med([r["app_cpu_us"] for r in rs]),
            "wrk_us": med([r["wrk_cpu_us"] for r in rs]),
            "busy": med([r["busy"] for r in rs]),
            "rounds": [r["rps"] for r in rs],
            "batch": med([r.get("batch") for r in rs]) if key not in ("unguarded",) else None,
            "rss": med([r["rss_kib"] / 1024 for r in rs if r["rss_kib"]]),
            "ratio": ratio(key, "unguarded"),
            "problems": problems,
            "evalsha_per_req": med([r.get("evalsha_per_req") for r in rs]),
            "reads_per_evalsha": med([r.get("reads_per_evalsha") for r in rs]),
            # Per master, smallest first: the median of each position.
            "master_shares": [med(list(x)) for x in zip(*[r["master_shares"] for r in rs
                                                          if r.get("master_shares")])],
        })
    by = {r["key"]: r for r in rows}
    # Medians over the rounds, and ratios to the floor within each round.
    cost = {limit: {subject: {k: med([c[subject][k] for c in rounds]) for k in rounds[0][subject]}
                    for subject in rounds[0]}
            for limit, rounds in costs.items()}

    def floor_ratio(limit, figure):
        return med([c["sliding_window"][figure] / c["floor"][figure] for c in costs[limit]])

    floor = {(limit, figure): floor_ratio(limit, figure)
             for limit in (10, 100000) for figure in ("one_usec", "batch_usec", "spread_usec",
                                                       "batch_cpu_usec", "spread_cpu_usec")}

    many = runs["denied_many"]
    rss_growth = med([(r["rss_kib"] - r["rss_before_kib"]) / 1024 for r in many
                      if r["rss_kib"] and r["rss_before_kib"]])
    stall = {"p50": med([r["p50"] for r in runs["stalled"]]),
             "p99": med([r["p99"] for r in runs["stalled"]])}
    side = {"p50": med([r.get("side_p50") for r in runs["stalled_side"]]),
            "p99": med([r.get("side_p99") for r in runs["stalled_side"]])}
    slowest = max((r.get("slowlog_max_us", 0) for r in runs["sliding"]), default=0) / 1000
    targets = [
        ("one rule (2) / unguarded (1) ≥ 0.8", ratio("sliding", "unguarded"), 0.8, ">="),
        ("two rules (4) / one rule (2) ≥ 0.9", ratio("two_rules", "sliding"), 0.9, ">="),
        ("axum, one rule (10b) / axum unguarded (10a) ≥ 0.75",
         ratio("axum_sliding", "axum_unguarded"), 0.75, ">="),
        ("per-worker tick batch (2) / dispatcher threads (2t) ≥ 1",
         ratio("sliding", "sliding_threads"), 1.0, ">="),
        ("one rule (2) / async reference (7) ≥ 1.3", ratio("sliding", "reference"), 1.3, ">="),
        ("one rule (2) / actix-limitation (6) ≥ 6", ratio("sliding", "actix_limitation"), 6.0, ">="),
        ("denied flood on one key (3a) / unguarded (1) ≥ 0.9",
         ratio("denied_status", "unguarded"), 0.9, ">="),
        ("denied, redirect (3b) / unguarded (1) ≥ 0.9",
         ratio("denied_redirect", "unguarded"), 0.9, ">="),
        (f"denied flood over {DISTINCT_KEYS} keys (3c): server RSS growth MiB ≤ 64",
         rss_growth, 64.0, "<="),
        ("stalled Redis (8): median decision ms ≤ 5", stall["p50"], 5.0, "<="),
        (f"stalled Redis (8): p99 decision ms ≤ the timeout ({STALL_TIMEOUT_MS})",
         stall["p99"], float(STALL_TIMEOUT_MS), "<="),
        (f"stalled Redis (8b): p99 ms of an unguarded route ({SIDE_UNGUARDED}) beside guarded "
         f"traffic ≤ 10", side["p99"], 10.0, "<="),
        ("worst single call in the SLOWLOG during (2), limit 100000, ms ≤ 2", slowest, 2.0, "<="),
        ("one rule (2): server CPU per request / unguarded (1) ≤ 1.2",
         ratio("sliding", "unguarded", "app_cpu_us"), 1.2, "<="),
        ("sliding window, Redis µs/decision, 20 per call on one key: limit 100000 / limit 10 ≤ 1.2",
         med([a["sliding_window"]["batch_usec"] / b["sliding_window"]["batch_usec"]
              for a, b in zip(costs[100000], costs[10])]), 1.2, "<="),
        ("sliding window / plain log (floor), Redis µs/decision, 20 per call on one key, "
         "limit 10 ≤ 1.15", floor[(10, "batch_usec")], 1.15, "<="),
        ("sliding window / floor, same, limit 100000 ≤ 1.15",
         floor[(100000, "batch_usec")], 1.15, "<="),
        ("sliding window / floor, Redis µs/decision, 20 keys one each per call, limit 10 ≤ 1.15",
         floor[(10, "spread_usec")], 1.15, "<="),
        ("sliding window / floor, same, limit 100000 ≤ 1.15",
         floor[(100000, "spread_usec")], 1.15, "<="),
        ("p99 of (2) / p99 of (7) ≤ 1", ratio("sliding", "reference", "p99"), 1.0, "<="),
        (f"cluster, {SPREAD_IDS} identities (9b) / single server, {SPREAD_IDS} identities (2s) ≥ 0.85",
         ratio("cluster_spread", "sliding_spread"), 0.85, ">="),
        (f"cluster, {SPREAD_IDS} identities (9b): smallest master's share of FCALL calls ≥ 0.20",
         med([min(r["master_shares"]) for r in runs["cluster_spread"] if r.get("master_shares")]),
         0.2, ">="),
        (f"cluster, {SPREAD_IDS} identities (9b): largest master's share of FCALL calls ≤ 0.50",
         med([max(r["master_shares"]) for r in runs["cluster_spread"] if r.get("master_shares")]),
         0.5, "<="),
    ]
    results = []
    for name, value, bound, op in targets:
        ok = value is not None and (value >= bound if op == ">=" else value <= bound)
        results.append((name, value, ok))
        log(f"target {name}: {fmt(value, '.2f')} {'pass' if ok else 'miss'}")

    final_rss = runs["sliding"][-1]["rss_kib"] / 1024 if runs["sliding"][-1]["rss_kib"] else None
    extra = {"many": many, "stall": stall, "side": side, "slowest_ms": slowest,
             "p999_ms": med([r.get("slowlog_p999_us") for r in runs["sliding"]]) / 1000,
             "over_2ms": sum(r.get("slowlog_over_2ms", 0) for r in runs["sliding"]),
             "slowlog_calls": sum(r.get("slowlog_calls", 0) for r in runs["sliding"]),
             "cluster_vs_single": ratio("cluster_spread", "sliding_spread"),
             "hot_cluster_vs_single": ratio("cluster", "sliding")}
    md = render(host, rows, by, cost, floor, results, elapsed, final_rss, a.build_seconds, extra)
    print(md)
    if a.out != "-":
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(md)
        log(f"wrote {a.out}")
    if any(r["problems"] for r in rows):
        log("some cases did not answer as expected: see 'checks' in the table")
        sys.exit(1)


def render(host, rows, by, cost, floor, results, elapsed, final_rss, build_seconds, extra):
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = []
    w = out.append
    w("# floodgate benchmarks")
    w("")
    w(f"Written by `scripts/bench` on {now} from one run; run it again to measure "
      "another machine or another version (it rewrites this file).")
    w("")
    w("## Machine")
    w("")
    w(f"- {host['cores']} cores, {host['model']}, {host['memory']} memory, Linux {host['kernel']}")
    w(f"- Redis {host['redis']}, {host['wrk']}, {host['rustc']}")
    w(f"- load average when the run started: {host['load']}. The machine is shared, so "
      "the numbers are noisy: the cases alternate and medians are quoted.")
    w("")
    w("## Method")
    w("")
    w(f"wrk, the server under test and Redis share the machine, all on 127.0.0.1. "
      f"Each case: a fresh server with {WORKERS} workers, one request checked by hand, "
      f"a {WARMUP} s warm-up, `CONFIG RESETSTAT`, then `wrk -t1 -c{CONNECTIONS} "
      f"-d{SECONDS}s --latency`. The {len(rows)} cases run in order, then in reverse "
      f"order, {ROUNDS} round{'s' if ROUNDS != 1 else ''} ({elapsed / 60:.1f} min"
      + (f", after a {build_seconds} s release build" if build_seconds is not None else "")
      + "). Figures are "
      "medians over the rounds; a ratio is the median of the ratios within each round. "
      "Floodgate's guarded cases guard `/healthz` itself (rules apply before routing), "
      "so case 1 differs from them only by the rule. The allowing rules have limit "
      "100000 per 1 s window (token bucket: burst 100000, 10^6/s), far above any rate "
      "reached here; the denying rule has limit 1 per hour, used up before the warm-up. "
      "Cases 6 and 7 are the bench-only servers in `benches/`, serving `GET /check` "
      "(`ok`), keyed by client address like floodgate's `ip`; actix-limitation's limit "
      "is set so that it always allows too.")
    w("")
    w("## Throughput and latency")
    w("")
    w("| case | req/s | vs 1 | p50 ms | p99 ms | non-2xx | checks |")
    w("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        non2xx = f"{r['non2xx']} (all 429, expected)" if r["expected_non2xx"] else str(r["non2xx"])
        if r["key"] == "denied_redirect":
            non2xx += " (all 303)"
        checks = "ok" if not r["problems"] else "; ".join(r["problems"])
        w(f"| {r['label']} | {r['rps']:.0f} | {r['ratio']:.2f} | {r['p50']:.2f} | "
          f"{r['p99']:.2f} | {non2xx} | {checks} |")
    w("")
    w("non-2xx is wrk's count (it does not count 3xx) summed over the rounds; *checks* "
      "also reads floodgate's `/metrics` before and after each measured run: no denial and "
      "no Redis error where every request should be allowed; no admission, a denial per "
      "request and some of them from the denial cache where every request should be denied; "
      "only error-policy answers while Redis is stalled.")
    w("")
    w("## Where the CPU goes")
    w("")
    w("| case | server CPU µs/req | Redis µs/decision | Redis CPU µs/decision | "
      "wrk CPU µs/req | machine busy | batch | server RSS MiB |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        w(f"| {r['label']} | {fmt(r['app_us'], '.1f')} | {fmt(r['cmd_us'], '.2f')} | "
          f"{fmt(r['cpu_us'], '.1f')} | {fmt(r['wrk_us'], '.1f')} | "
          f"{fmt(None if r['busy'] is None else 100 * r['busy'], '.0f')}% | "
          f"{fmt(r['batch'], '.1f')} | {fmt(r['rss'], '.1f')} |")
    w("")
    w("- **server CPU**: user + system time of the server process over the measured "
      "run (/proc), per request wrk completed; **wrk CPU** likewise for wrk.")
    w("- **Redis µs/decision**: time Redis spent executing the limiter's commands "
      "(`INFO commandstats`: `fcall` for the batch function and `eval` for the worker "
      "lane's marker before each, every command for "
      "actix-limitation, whose cost is mostly a new connection per request and so "
      "shows in the next column), per request.")
    w("- **Redis CPU µs/decision**: user + system time of redis-server (`INFO cpu`), "
      "network I/O included, per request.")
    w("- **machine busy**: share of both cores not idle during the run (/proc/stat), "
      "whoever used it. **batch**: decisions per `FCALL` (floodgate's dispatchers send "
      "every pending decision in one call; the reference sends one per call).")
    w("- **server RSS**: VmRSS of the server at the end of its measured run.")
    w("")
    one, guard = by["unguarded"], by["sliding"]
    if all(v is not None for v in (one["app_us"], guard["app_us"], guard["cpu_us"])):
        w(f"In this run one sliding-window rule added {guard['app_us'] - one['app_us']:.1f} µs "
          f"of server CPU and {guard['cpu_us']:.1f} µs of Redis CPU to each request "
          f"(unguarded: {one['app_us']:.1f} µs of server CPU), while the machine was "
          f"{100 * guard['busy']:.0f}% busy in case 2 against {100 * one['busy']:.0f}% in "
          "case 1.")
        w("")
    w("## Under flood and failure")
    w("")
    w(f"- **Denied flood on one key** (3a, 3b): after the first denial the process remembers it "
      f"(the denial cache), so the flood costs no Redis call: {by['denied_status']['ratio']:.2f} "
      f"(429) and {by['denied_redirect']['ratio']:.2f} (303) of unguarded throughput, "
      f"{fmt(by['denied_status']['app_us'], '.1f')} µs of server CPU per request against "
      f"{fmt(by['unguarded']['app_us'], '.1f')} unguarded.")
    before = med([r["rss_before_kib"] / 1024 for r in extra["many"] if r["rss_before_kib"]])
    after = med([r["rss_kib"] / 1024 for r in extra["many"] if r["rss_kib"]])
    w(f"- **Denied flood over {DISTINCT_KEYS} distinct keys** (3c): wrk cycles a header key over "
      f"{DISTINCT_KEYS} values, limit 1 per hour each; the warm-up goes on until every key has "
      f"been allowed once and denied once, so the measured run is all denials. Server VmRSS "
      f"{fmt(before, '.1f')} MiB before the warm-up, {fmt(after, '.1f')} MiB after the run; the "
      f"denial cache holds at most 32768 keys, so "
      f"{fmt(med([r.get('hit_share') for r in extra['many']]), '.0%')} of the denials came from "
      "it and the rest from Redis.")
    w(f"- **Stalled Redis** (8): Redis is paused (`CLIENT PAUSE`) for the whole measured run, "
      f"`redis.timeout` = {STALL_TIMEOUT_MS} ms, `[limiter] breaker` = 1 s, `on_redis_error = "
      f"\"allow\"`: response time median {fmt(extra['stall']['p50'], '.2f')} ms, p99 "
      f"{fmt(extra['stall']['p99'], '.2f')} ms (only the calls that open the breaker, and one "
      "probe per breaker period, wait for the timeout).")
    w(f"- **Beside a stalled Redis** (8b): the same stall, one sliding rule on `{SIDE_GUARDED}` "
      f"driven by wrk, and a second wrk on {SIDE_CONNECTIONS} connections of its own timing "
      f"`{SIDE_UNGUARDED}`, which no rule guards, on the same workers: median "
      f"{fmt(extra['side']['p50'], '.2f')} ms, p99 {fmt(extra['side']['p99'], '.2f')} ms (a "
      "worker waits a few ms at most for Redis before its lane's helper thread takes the call).")
    w(f"- **Worst single call** in Redis's SLOWLOG (every call logged) during case 2, a sliding "
      f"window with limit 100000 over 1 s, entries leaving all the time: "
      f"{extra['slowest_ms']:.2f} ms over the rounds (one call decides a whole batch); 99.9% "
      f"of the calls took at most {extra['p999_ms']:.3f} ms (median over the rounds), and "
      f"{extra['over_2ms']} of {extra['slowlog_calls']} took more than 2 ms. The SLOWLOG "
      "measures wall time: a call during which the kernel ran wrk or the server instead of "
      "Redis on the two shared cores counts that wait too.")
    w("")
    w("## Redis Cluster")
    w("")
    w("`scripts/bench` also starts a private Redis Cluster of 3 masters without replicas "
      "(the same redis-server, on 127.0.0.1, no persistence) and stops it at exit. Cases 9a "
      "and 9b serve the same sliding rule as case 2 (limit 100000 per 1 s) from floodgate "
      "configured with `[redis] cluster = [the three masters]`. 9a keys by client address "
      "like case 2: all the traffic is one key, so one slot on one master, and the figure shows "
      "what the cluster client costs when the cluster cannot spread anything. 9b keys by a "
      f"header that wrk cycles over {SPREAD_IDS} values, and 2s is the same rule and traffic on "
      "the single server, so 9b / 2s compares like with like. For the cluster cases every "
      "master is flushed and its statistics reset before the measured run, and the Redis "
      "columns above are summed over the 3 masters. The masters share the machine's "
      f"{host['cores']} cores with floodgate and wrk: here a cluster adds processes competing "
      "for the same CPU rather than capacity, so these cases measure the client's overhead, "
      "not how far a cluster scales.")
    w("")
    w("| case | req/s | FCALL per request | decisions per FCALL | Redis reads per FCALL | "
      "each master's share of FCALL calls |")
    w("|---|---:|---:|---:|---:|---|")
    for k in ("sliding", "sliding_spread", "cluster", "cluster_spread"):
        r = by[k]
        shares = " / ".join(f"{100 * x:.0f}%" for x in r["master_shares"]) or "—"
        if k not in CLUSTER_CASES:
            shares += " (one server)"
        w(f"| {r['label']} | {r['rps']:.0f} | {fmt(r['evalsha_per_req'], '.3f')} | "
          f"{fmt(r['batch'], '.1f')} | {fmt(r['reads_per_evalsha'], '.2f')} | {shares} |")
    w("")
    w("- **FCALL per request**: decision calls over the requests wrk completed. On one server "
      "a call decides every decision pending in the batch, whatever their keys; on a cluster a "
      "batch becomes one call per master it touches (the cluster's function is flagged "
      "allow-cross-slot-keys), and per slot while slots move.")
    w("- **Redis reads per FCALL**: how many times Redis read a client socket "
      "(`total_reads_processed` in `INFO stats`, summed over the masters; every command "
      "counts, the bench's own few `INFO` calls too) per script call. About 1 means each call "
      "arrived on its own, one round trip each; well below 1 means several calls arrived in "
      "one read (pipelined). Above 1, a call was big enough to take several reads: on one "
      "server a call carries a whole batch.")
    w("- **share**: each master's part of the script calls, smallest first; with "
      f"{SPREAD_IDS} identities the hash slots spread them over the three.")
    w("")
    w(f"In this run the cluster with {SPREAD_IDS} identities reached "
      f"{fmt(extra['cluster_vs_single'], '.2f')} of the single server's throughput on the "
      f"same traffic (9b / 2s), and with one hot key {fmt(extra['hot_cluster_vs_single'], '.2f')} "
      "of it (9a / 2).")
    w("")
    w("## Redis cost per decision, by algorithm and limit")
    w("")
    w("`reference_async cost` (in `benches/`) drives floodgate's own script on a pinned "
      "clock (the script's `now` argument), and beside it `benches/floor_sliding_log.lua`, "
      "the plain sliding-window log (LLEN and LINDEX, then LPUSH, LTRIM and PEXPIRE, "
      "nothing else: no operator records, deadlines, error isolation, exact remaining "
      "count or wait), with the same jobs in the same calls. Each key is filled to its "
      "limit with requests spaced so that the limit fits one window exactly (the logs; "
      "the other algorithms get 1000 requests, their cost does not depend on how full "
      "they are), then decides requests on the same schedule: at the limit, each lets one "
      "old entry out and takes one in, the most work an allowed decision does. Three "
      "shapes: *one* request per call; *batch*: 20 requests on one key per call (a busy "
      "identity); *spread*: one request on each of 20 keys per call (many identities). "
      f"{COST_CALLS} decisions per figure; time per decision of the calls (`FCALL` "
      "of floodgate's batch function, `EVALSHA` of the floor script; `INFO "
      "commandstats`); *bytes* is the key's `MEMORY USAGE` after the run; the window is "
      "10 min (at 10^9, 10^9 ms); medians over the rounds.")
    w("")
    w("| algorithm | limit | one µs | batch µs | spread µs | Redis CPU µs, batch | "
      "denied, one µs | bytes per key |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|")
    for subject in ("sliding_window", "floor", "fixed_window", "token_bucket", "gcra",
                    "sliding_counter"):
        for limit in COST_LIMITS:
            c = cost[limit].get(subject)
            if not c:
                continue
            name = "plain log (floor)" if subject == "floor" else subject
            w(f"| {name} | {limit} | {c['one_usec']:.2f} | {c['batch_usec']:.2f} | "
              f"{c['spread_usec']:.2f} | {c['batch_cpu_usec']:.2f} | "
              f"{fmt(c.get('denied_usec'), '.2f')} | {fmt(c['memory_bytes'], '.0f')} |")
    w("")
    w("The sliding window against the floor (ratios within each round, medians):")
    w("")
    w("| limit | one | batch | spread | Redis CPU, batch | Redis CPU, spread |")
    w("|---:|---:|---:|---:|---:|---:|")
    for limit in (10, 100000):
        w(f"| {limit} | " + " | ".join(
            fmt(floor[(limit, f)], ".2f") + "x"
            for f in ("one_usec", "batch_usec", "spread_usec", "batch_cpu_usec",
                      "spread_cpu_usec")) + " |")
    w("")
    if final_rss:
        w(f"floodgate's resident memory (VmRSS) after the last guarded run: {final_rss:.1f} MiB.")
        w("")
    w("## Targets")
    w("")
    w("| target | figure | result |")
    w("|---|---:|---|")
    for name, value, ok in results:
        w(f"| {name} | {fmt(value, '.2f')} | {'pass' if ok else '**miss**'} |")
    w("")
    w("## Every round")
    w("")
    n = len(rows[0]["rounds"])
    w("| case | " + " | ".join(f"round {i + 1} req/s" for i in range(n)) + " |")
    w("|---|" + "---:|" * n)
    for r in rows:
        w(f"| {r['label']} | " + " | ".join(f"{x:.0f}" for x in r["rounds"]) + " |")
    w("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
