#!/usr/bin/env python3
"""The Envoy rate-limit service half of scripts/bench (run that, not this: it
builds the binaries and starts the Redis this expects).

Starts `floodgate rls` (release) on free 127.0.0.1 ports against the given
Redis and, with `--peer` (benches/limitador_peer, built by scripts/bench),
Limitador in each of its two modes (counting in Redis on every call;
counting in memory and flushing to Redis) on ports of their own against the
same Redis, all three up front. Drives them with benches/rls_load.rs, a
tonic gRPC load generator keeping 64 ShouldRateLimit calls in flight,
through the cases: (a) a descriptor that matches no limit (the floor: the
gRPC cost alone), (b) one limit, (c) two limits in one call, (d) one limit
over 1000 distinct values. In every round each server runs its cases one
after another (its floor and its limits seconds apart), servers and cases
in one order and reversed in the next round, so a machine getting busier or
quieter weighs on all of them alike; a ratio is the median over the rounds
of the ratios within each round. Every server and
round sends descriptor values of its own (the Limitador peer's keys carry
no prefix of the instance, so its two modes would otherwise count on the
same keys). After the rounds: each peer's exactness, then floodgate's (e)
a Redis stall (SIGSTOP for part of the run: how fast answers still come),
and floodgate's exactness once a probe call gets through again (2000 calls
at once, 64 in flight, on one fresh key with a limit of 1000: the OKs are
counted). Reports calls per second (median over rounds), each against the
floor, p50 and p99 latency, the service's CPU and Redis's CPU per call, and
writes floodgate's table, then one per peer mode beside floodgate's floor,
into the output file between its markers.
"""

import argparse
import json
import os
import re
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The peer's modes: its --mode, and what the table calls it.
PEER_MODES = [
    ("exact", "`AsyncRedisStorage`: every call counted in Redis"),
    ("cached", "`CachedRedisStorage`, default settings: counted in the process, flushed to Redis "
     "every second (so one process's count is exact; processes sharing Redis learn of each other's "
     "hits at the flushes)"),
]

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


def wait_listening(server, port, name):
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                raise SystemExit(f"bench: {name} did not start")
            time.sleep(0.05)


def stop(server, name):
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        say(f"{name} did not stop on SIGTERM within 30 s: killed")
        server.kill()
        server.wait()


def exactness(tool, endpoint, tag):
    """2000 calls, INFLIGHT at once, on one fresh key limited to 1000."""
    return json.loads(subprocess.run(
        [tool, "--endpoint", endpoint, "--case", "exact", "--calls", "2000",
         "--inflight", str(INFLIGHT), "--tag", tag],
        capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


def rounds(tool, url, servers):
    """Cases (a) to (d) against every server, ROUNDS times. Within a round
    each server runs its cases one after another, so that its floor and its
    limits are measured seconds apart; every other round reverses both the
    servers and the cases, so a machine getting busier or quieter weighs on
    all of them alike. `servers` is a list of (name, endpoint, pid, tag);
    the tag and the round make the descriptor values, so no two servers or
    rounds count on the same key. Returns each server's medians per case,
    with `of_floor` (the median over the rounds of the case against the
    server's own floor in that round) and `of_first_floor` (against the
    first server's floor in that round)."""
    runs = {name: {c: [] for c, _ in CASES} for name, _, _, _ in servers}
    for rnd in range(ROUNDS):
        order = servers if rnd % 2 == 0 else list(reversed(servers))
        cases = CASES if rnd % 2 == 0 else list(reversed(CASES))
        for name, endpoint, pid, tag in order:
            for case, _ in cases:
                r = measure(tool, endpoint, case, url, pid, f"{tag}r{rnd}")
                say(f"{name} round {rnd + 1}: {case}: {r['calls_per_s']:.0f} calls/s, p99 {r['p99_us']} us")
                runs[name][case].append(r)
    first = servers[0][0]
    out = {}
    for name in runs:
        out[name] = {}
        for c, _ in CASES:
            m = {k: statistics.median(r[k] for r in runs[name][c])
                 for k in ("calls_per_s", "p50_us", "p99_us", "redis_us", "server_us")}
            for key, floor_of in (("of_floor", name), ("of_first_floor", first)):
                m[key] = statistics.median(
                    r["calls_per_s"] / max(f["calls_per_s"], 1)
                    for r, f in zip(runs[name][c], runs[floor_of]["none"]))
            out[name][c] = m
    return out


def limitador_version():
    """The limitador crate version the peer was built with (its Cargo.lock)."""
    try:
        text = open(os.path.join(ROOT, "benches", "limitador_peer", "Cargo.lock")).read()
    except OSError:
        return "?"
    m = re.search(r'name = "limitador"\nversion = "([^"]+)"', text)
    return m.group(1) if m else "?"


def start_peer(peer, mode, url, work):
    """The Limitador peer in one mode on a free port: (process, port), not yet
    listening perhaps (wait_listening)."""
    port = free_port()
    log = open(os.path.join(work, f"limitador-{mode}.log"), "w")
    server = subprocess.Popen(
        [peer, "--listen", f"127.0.0.1:{port}", "--redis", url, "--mode", mode], stderr=log)
    return server, port


def wait_answering(tool, endpoint, deadline_s=10.0):
    """Waits until a short probe run of one limit gets no error (after the
    stall, the breaker may still be open or Redis's connections coming back);
    gives up after deadline_s and says so."""
    began = time.time()
    deadline = began + deadline_s
    while True:
        try:
            r = json.loads(subprocess.run(
                [tool, "--endpoint", endpoint, "--case", "one", "--seconds", "0.05",
                 "--warmup", "0", "--inflight", "1", "--tag", f"probe{os.getpid()}"],
                capture_output=True, text=True, check=True, timeout=deadline_s).stdout
                .strip().splitlines()[-1])
            if r["errors"] == 0 and r["ok"] > 0:
                say(f"rls answers without error again ({time.time() - began:.2f} s after the stall's run)")
                return
        except (subprocess.SubprocessError, ValueError, IndexError, KeyError):
            pass
        if time.time() > deadline:
            say(f"a probe call still got an error {deadline_s:g} s after the stall: measuring exactness anyway")
            return
        time.sleep(0.05)


def measure(tool, endpoint, case, url, pid, tag):
    r0, s0 = redis_cpu(url), proc_cpu(pid)
    result = load(tool, endpoint, case, ("--tag", tag))
    r1, s1 = redis_cpu(url), proc_cpu(pid)
    # CPU over the whole run, warm-up included: divided by every call made.
    total = max(result["calls"] * (SECONDS + WARMUP) / SECONDS, 1)
    result["redis_us"] = (r1 - r0) * 1e6 / total
    result["server_us"] = (s1 - s0) * 1e6 / total
    return result


def peer_lines(peer):
    """The second table: the same load against Limitador, beside floodgate's floor."""
    if peer is None:
        return ["Not measured in this run: the same load against Limitador on the same Redis "
                "(scripts/bench_rls.py without `--peer`)."]
    version = limitador_version()
    lines = [
        f"#### The same load against Limitador (crate version {version}, Redis storage) behind a "
        "minimal tonic server of the benchmark's own",
        "",
        "benches/limitador_peer: the `limitador` crate with its Redis storage only (the newest "
        "release that builds so: later ones need the RocksDB disk storage feature, Kuadrant/limitador "
        "issue #459), the same limits "
        "(namespace `bench`; `one` and `two` 100000 per second, `exact` 1000 per hour, each counted "
        "per descriptor value: a Limitador limit with the descriptor key as its variable, every "
        "descriptor entry put in one map of key to value as Limitador's own server does), on the "
        "same Redis (flushed once, before the rounds; every server and round with descriptor values "
        "of its own, so no two count on the same key); the same load generator, cases and measures "
        "as above, measured in the same rounds as floodgate: in every round each server runs its "
        "cases one after another, servers and cases in one order and reversed in the next. *of its "
        "floor*: against the same mode's case (a) of the same round; *of floodgate's floor*: against "
        "floodgate's case (a) of the same round; each the median over the rounds.",
        "",
    ]
    for mode, title in PEER_MODES:
        med, exact = peer[mode]
        lines += [
            f"`--mode {mode}`, {title}:",
            "",
            "| case | calls/s | of its floor | of floodgate's floor | p50 | p99 | service CPU/call | Redis CPU/call |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for case, case_title in CASES:
            m = med[case]
            lines.append(
                f"| {case_title} | {m['calls_per_s']:.0f} | {m['of_floor']:.2f} | "
                f"{m['of_first_floor']:.2f} | {m['p50_us']:.0f} us | {m['p99_us']:.0f} us | "
                f"{m['server_us']:.1f} us | {m['redis_us']:.1f} us |")
        lines += [
            "",
            f"Exactness, `--mode {mode}`: {exact['calls']} calls at once ({INFLIGHT} in flight) on one "
            f"key with a limit of 1000: {exact['ok']} OK, {exact['over']} OVER_LIMIT, "
            f"{exact['errors']} errors.",
            "",
        ]
    return lines[:-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis", required=True)
    ap.add_argument("--redis-pid-file", required=True)
    ap.add_argument("--floodgate", required=True)
    ap.add_argument("--load", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--peer", help="benches/limitador_peer's binary: measure Limitador too")
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
    peers = {}  # mode: (process, endpoint)
    try:
        wait_listening(server, grpc, "floodgate rls")
        if a.peer:
            for mode, _ in PEER_MODES:
                proc, port = start_peer(a.peer, mode, a.redis, work)
                peers[mode] = (proc, f"http://127.0.0.1:{port}")
                wait_listening(proc, port, f"the Limitador peer ({mode})")
        servers = [("rls", endpoint, server.pid, "fg")] + [
            (f"limitador {mode}", ep, proc.pid, f"lim{mode}") for mode, (proc, ep) in peers.items()]
        med_all = rounds(a.load, a.redis, servers)
        med = med_all["rls"]
        # Each peer's exactness: 2000 calls, 64 at once, on one fresh key limited to 1000.
        peer = None
        if a.peer:
            peer = {}
            for mode, (_, ep) in peers.items():
                exact = exactness(a.load, ep, f"limexact{mode}{os.getpid()}")
                say(f"limitador {mode} exact: {exact}")
                peer[mode] = (med_all[f"limitador {mode}"], exact)
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
        # Exactness: 2000 calls, 64 at once, on one fresh key limited to 1000,
        # once the service answers without error again after the stall.
        wait_answering(a.load, endpoint)
        exact = exactness(a.load, endpoint, f"exact{os.getpid()}")
        say(f"rls exact: {exact}")
    finally:
        stop(server, "floodgate rls")
        for mode, (proc, _) in peers.items():
            stop(proc, f"the Limitador peer ({mode})")
            if proc.returncode != 0:
                say(f"the Limitador peer ({mode}) exited with {proc.returncode} on SIGTERM")

    lines = [
        BEGIN,
        "",
        f"### Envoy's rate-limit service (`floodgate rls`)",
        "",
        f"{INFLIGHT} `ShouldRateLimit` calls in flight from benches/rls_load.rs (tonic, 4 HTTP/2 connections), "
        f"{ROUNDS} rounds of {SECONDS:g} s after {WARMUP:g} s of warm-up, medians; *of the floor*: the "
        "median over the rounds of the case against case (a) of the same round (a server's cases run one "
        "after another in each round, in one order and reversed in the next); the default algorithm "
        "(sliding window), limits high enough never to deny. CPU per call: the service process's and "
        "Redis's, over the whole run.",
        "",
        "| case | calls/s | of the floor | p50 | p99 | service CPU/call | Redis CPU/call |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, title in CASES:
        m = med[case]
        lines.append(f"| {title} | {m['calls_per_s']:.0f} | {m['of_floor']:.2f} | "
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
    ]
    lines += peer_lines(peer)
    lines += [
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
