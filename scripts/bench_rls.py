#!/usr/bin/env python3
"""The Envoy rate-limit service half of scripts/bench (run that, not this: it
builds the binaries and starts the Redis this expects).

Starts `floodgate rls` (release) on free 127.0.0.1 ports against the given
Redis, and drives it with benches/rls_load.rs, a tonic gRPC load generator
keeping 64 ShouldRateLimit calls in flight, through the cases: (a) a
descriptor that matches no limit (the floor: the gRPC cost alone), (b) one
limit, (c) two limits in one call, (d) one limit over 1000 distinct values,
each round in one order then reversed; then (e) a Redis stall (SIGSTOP for
part of the run: how fast answers still come), and exactness (2000 calls
at once, 64 in flight, on one key with a limit of 1000: the OKs are counted).
Reports calls per second (median over rounds), each against the floor, p50
and p99 latency, the service's CPU and Redis's CPU per call, and writes the
table into the output file between its markers.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
SECONDS = float(os.environ.get("BENCH_SECONDS", "5"))
WARMUP = float(os.environ.get("BENCH_WARMUP", "1"))
INFLIGHT = int(os.environ.get("BENCH_INFLIGHT", "64"))
BEGIN = "<!-- rls-bench: begin (scripts/bench writes this part) -->"
END = "<!-- rls-bench: end -->"

DESCRIPTORS = """domain: bench
descriptors:
  - key: one
    rate_limit: {unit: second, requests_per_unit: 100000}
  - key: two
    rate_limit: {unit: second, requests_per_unit: 100000}
  - key: exact
    rate_limit: {unit: hour, requests_per_unit: 1000}
"""

CASES = [
    ("none", "(a) no limit matched: the floor"),
    ("one", "(b) one limit"),
    ("two", "(c) two limits in one call"),
    ("spread", "(d) one limit over 1000 values"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say(text):
    print(f"floodgate: {text}", file=sys.stderr, flush=True)


def redis_cli(url, *args):
    return subprocess.run(["redis-cli", "-u", url, *args], capture_output=True, text=True, check=True).stdout


def redis_cpu(url):
    info = redis_cli(url, "INFO", "cpu")
    values = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    return float(values["used_cpu_sys"]) + float(values["used_cpu_user"])


def proc_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def load(tool, endpoint, case, extra=()):
    out = subprocess.run(
        [tool, "--endpoint", endpoint, "--case", case, "--seconds", str(SECONDS),
         "--warmup", str(WARMUP), "--inflight", str(INFLIGHT), *extra],
        capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(tool, endpoint, case, url, pid, tag):
    r0, s0 = redis_cpu(url), proc_cpu(pid)
    result = load(tool, endpoint, case, ("--tag", tag))
    r1, s1 = redis_cpu(url), proc_cpu(pid)
    # CPU over the whole run, warm-up included: divided by every call made.
    total = max(result["calls"] * (SECONDS + WARMUP) / SECONDS, 1)
    result["redis_us"] = (r1 - r0) * 1e6 / total
    result["server_us"] = (s1 - s0) * 1e6 / total
    return result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--redis-pid-file", required=True)
    ap.add_argument("--floodgate", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    work = os.path.join(a.work, "rls")
    os.makedirs(os.path.join(work, "descriptors"), exist_ok=True)
    with open(os.path.join(work, "descriptors", "bench.yaml"), "w") as f:
        f.write(DESCRIPTORS)
    grpc, http = free_port(), free_port()
    config = os.path.join(work, "rls.toml")
    with open(config, "w") as f:
        f.write(f'[rls]\nbind = "127.0.0.1:{grpc}"\nhttp_bind = "127.0.0.1:{http}"\n'
                f'descriptors = "{work}/descriptors"\n\n[redis]\nurl = "{a.redis}"\n'
                f'key_prefix = "rlsbench"\ntimeout = "250ms"\n')
    redis_cli(a.redis, "FLUSHALL")
    log = open(os.path.join(work, "rls.log"), "w")
    server = subprocess.Popen([a.floodgate, "rls", "--config", config], stderr=log,
                              env={**os.environ, "RUST_LOG": "warn"})
    endpoint = f"http://127.0.0.1:{grpc}"
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", grpc), timeout=1).close()
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit("bench: floodgate rls did not start")
            time.sleep(0.05)
    try:
        runs = {c: [] for c, _ in CASES}
        for rnd in range(ROUNDS):
            order = CASES if rnd % 2 == 0 else list(reversed(CASES))
            for case, _ in order:
                r = measure(a.load, endpoint, case, a.redis, server.pid, f"r{rnd}")
                say(f"rls round {rnd + 1}: {case}: {r['calls_per_s']:.0f} calls/s, p99 {r['p99_us']} us")
                runs[case].append(r)
        # (e) Redis stalled for 2 s in the middle of a run.
        with open(a.redis_pid_file) as f:
            redis_pid = int(f.read().strip())
        stall = subprocess.Popen(
            [a.load, "--endpoint", endpoint, "--case", "one", "--seconds", "3", "--warmup", "0.5",
             "--inflight", str(INFLIGHT), "--tag", "stall"], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        os.kill(redis_pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(redis_pid, signal.SIGCONT)
        stalled = json.loads(stall.communicate()[0].strip().splitlines()[-1])
        say(f"rls stall: {stalled}")
        # Exactness: 2000 calls, 64 at once, on one fresh key limited to 1000.
        exact = json.loads(subprocess.run(
            [a.load, "--endpoint", endpoint, "--case", "exact", "--calls", "2000",
             "--inflight", str(INFLIGHT), "--tag", f"exact{os.getpid()}"],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        say(f"rls exact: {exact}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()

    med = {c: {k: statistics.median(r[k] for r in runs[c])
               for k in ("calls_per_s", "p50_us", "p99_us", "redis_us", "server_us")}
           for c, _ in CASES}
    floor = med["none"]["calls_per_s"] or 1
    lines = [
        BEGIN,
        "",
        f"### Envoy's rate-limit service (`floodgate rls`)",
        "",
        f"{INFLIGHT} `ShouldRateLimit` calls in flight from benches/rls_load.rs (tonic, 4 HTTP/2 connections), "
        f"{ROUNDS} rounds of {SECONDS:g} s after {WARMUP:g} s of warm-up, medians; the default algorithm "
        "(sliding window), limits high enough never to deny. CPU per call: the service process's and "
        "Redis's, over the whole run.",
        "",
        "| case | calls/s | of the floor | p50 | p99 | service CPU/call | Redis CPU/call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, title in CASES:
        m = med[case]
        lines.append(f"| {title} | {m['calls_per_s']:.0f} | {m['calls_per_s'] / floor:.2f} | "
                     f"{m['p50_us']:.0f} us | {m['p99_us']:.0f} us | {m['server_us']:.1f} us | {m['redis_us']:.1f} us |")
    lines += [
        "",
        f"(e) Redis stopped (SIGSTOP) for 2 s of a 3 s run of one limit, `on_redis_error = \"error\"`, "
        f"`redis.timeout = 250ms`, breaker 1 s: {stalled['calls_per_s']:.0f} answers/s, p50 "
        f"{stalled['p50_us']} us, p99 {stalled['p99_us']} us ({stalled['ok']} OK, {stalled['errors']} "
        "UNAVAILABLE): while the breaker is open the answers come at once, without Redis.",
        "",
        f"Exactness: {exact['calls']} calls at once ({INFLIGHT} in flight) on one key with a limit of 1000: "
        f"{exact['ok']} OK, {exact['over']} OVER_LIMIT, {exact['errors']} errors.",
        "",
        "Not measured here yet: the same load against a peer on the same Redis (Limitador).",
        "",
        END,
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if a.out != "-":
        text = open(a.out).read() if os.path.exists(a.out) else ""
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            text = head + table.rstrip("\n") + rest.split(END, 1)[1]
        else:
            text = text.rstrip("\n") + "\n\n" + table
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
