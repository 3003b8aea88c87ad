#!/usr/bin/env python3
"""The newer holder's wait behind an old holder's stalled body, through `fence proxy`.

For each of N jobs: a write with token 1 (the job's first), then an old holder's buffered
write (it has an Idempotency-Key) whose body stops after 10 of its 1,000 bytes and stays
open, then the newer holder's write with token 2, timed. A buffered body has not reached the
upstream, so the newer holder should not wait for it (issue 31); before, it waited for the
body deadline (--body-timeout, 30 s by default). Prints the median, p99 and max in ms.

Usage: bench/stalled_body.py FENCE_BIN BENCH_SINK_BIN [N=200]
(BENCH_SINK_BIN: `cargo build --release --example bench_sink`, run here as the upstream.)
"""
import socket
import subprocess
import sys
import tempfile
import time


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, deadline=20.0):
    end = time.time() + deadline
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def post(port, job, token, timeout=60.0):
    """One fenced POST on a connection of its own; the status."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    s.sendall(
        f"POST /w HTTP/1.1\r\nHost: x\r\nX-Fencing-Job: {job}\r\nX-Fencing-Token: {token}\r\n"
        "Content-Length: 1\r\nConnection: close\r\n\r\nx".encode()
    )
    answer = b""
    while b"\r\n" not in answer:
        chunk = s.recv(4096)
        if not chunk:
            break
        answer += chunk
    s.close()
    return int(answer.split(b" ")[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def main():
    fence, sink = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    up, proxy, admin = free_port(), free_port(), free_port()
    data = tempfile.mkdtemp()
    procs = [subprocess.Popen([sink, "bare", f"127.0.0.1:{up}"], stdout=subprocess.DEVNULL)]
    procs.append(subprocess.Popen(
        [fence, "proxy", "--listen", f"127.0.0.1:{proxy}", "--admin-listen",
         f"127.0.0.1:{admin}", "--upstream", f"http://127.0.0.1:{up}", "--data-dir", data],
        stderr=subprocess.DEVNULL))
    try:
        wait_port(up)
        wait_port(proxy)
        waits = []
        for i in range(n):
            job = f"stall-{i}"
            assert post(proxy, job, 1) == 200
            stalled = socket.create_connection(("127.0.0.1", proxy))
            stalled.sendall(
                f"POST /w HTTP/1.1\r\nHost: x\r\nX-Fencing-Job: {job}\r\nX-Fencing-Token: 1\r\n"
                f"Idempotency-Key: \"k{i}\"\r\nContent-Length: 1000\r\n\r\n0123456789".encode()
            )
            time.sleep(0.02)  # the stalled request is in, its body stopped
            started = time.perf_counter()
            status = post(proxy, job, 2)
            waits.append((time.perf_counter() - started) * 1000)
            assert status == 200, f"the newer holder got {status}"
            stalled.close()
        waits.sort()
        p = lambda q: waits[min(len(waits) - 1, int(len(waits) * q))]
        print(f"{n} newer holders behind a stalled buffered body: median {p(0.5):.2f} ms, "
              f"p99 {p(0.99):.2f} ms, max {waits[-1]:.2f} ms")
    finally:
        for p_ in procs:
            p_.kill()


if __name__ == "__main__":
    main()
