#!/usr/bin/env bash
# examples/sh/worker.sh against the real binaries: the worked example on a job id that needs
# percent-encoding (A claims generation 7, stalls past its lease, B claims 8 and writes, A's
# late write is refused 409 and A does not complete), then job ids a/b a%b a?b&c a+b (a '#'
# is a semaphore slot's, refused to a plain claim), each revoked while its worker writes to a
# slow service: the keeper's refused renewal must stop the worker before its next write; and,
# from a scripted lease server, answers the real one never gives (a renewal held open, a TTL
# out of range or above the one asked, another generation, 408s, an echo of the request).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); worker=${WORKER_SH:-$here/../../examples/sh/worker.sh}
FENCE=$(realpath -m "${FENCE_BIN:-$here/../../target/debug/fence}")
[ -x "$FENCE" ] || { echo "sh: FAIL: the fence binary is missing at $FENCE: build it or set FENCE_BIN" >&2; exit 1; }
tmp=$(mktemp -d); pids=()
trap 'for p in "${pids[@]}"; do kill -CONT "$p"; kill "$p"; done 2>/dev/null; rm -rf "$tmp"' EXIT
fail() { echo "sh: FAIL: $*" >&2; exit 1; }
ready() { for _ in $(seq 150); do grep -q "$2" "$1" 2>/dev/null && return; sleep 0.1; done; fail "no '$2' in $1: $(cat "$1")"; }
start() { "$FENCE" "${@:2}" 2>"$tmp/$1.log" & pids+=($!); ready "$tmp/$1.log" ' ready '; addr=$(grep -o 'listen=[^ ]*' "$tmp/$1.log" | head -1 | cut -d= -f2); }
# The service: logs "path job token body" per write; /slow answers after a second, /slower
# after three.
python3 -c 'import http.server as h, sys, time
class H(h.BaseHTTPRequestHandler):
    def do_POST(s):
        b = s.rfile.read(int(s.headers["content-length"] or 0)).decode()
        j, t = s.headers["x-fencing-job"], s.headers["x-fencing-token"]
        open(sys.argv[1] + ".log", "a").write(f"{s.path} {j} {t} {b}\n")
        time.sleep({"/slow": 1, "/slower": 3}.get(s.path, 0)); s.send_response(200); s.send_header("content-length", "0"); s.end_headers()
    def log_message(s, *a): pass
srv = h.ThreadingHTTPServer(("127.0.0.1", 0), H); open(sys.argv[1], "w").write(str(srv.server_port)); srv.serve_forever()' "$tmp/up" & pids+=($!)
ready "$tmp/up" .
start server server --listen 127.0.0.1:0 --data-dir "$tmp/leases"; S=http://$addr
start proxy proxy --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --upstream "http://127.0.0.1:$(cat "$tmp/up")" --data-dir "$tmp/sink"; P=http://$addr
run() { SERVER=$S DESTINATION=$P/$1 JOB=$2 TTL_MS=$3 WRITES=$4 sh "$worker"; }

job=inv/42
for _ in 1 2 3 4 5 6; do "$FENCE" claim --server "$S" --job "$job" --ttl 100ms >/dev/null; sleep 0.15; done
# A 3 s lease (renewed every second: one renewal late on a loaded machine does not lose it
# before the second write), and a stall of 8 s that outlasts it, leaving B some 5 s.
STALL_BEFORE_SEND=8 run ledger "$job" 3000 2 >"$tmp/a" 2>&1 & a=$!
ready "$tmp/a" 'holding inv/42 at generation 7'
# Until A's lease has expired on the server (however long A's start and renewals took).
for _ in $(seq 300); do
  "$FENCE" status --server "$S" --job "$job" | grep -q '"state":"expired"' && break; sleep 0.1
done
"$FENCE" status --server "$S" --job "$job" | grep -q '"state":"expired"' || fail "A's lease never expired: $(cat "$tmp/a")"
run ledger "$job" 10000 1 >"$tmp/b" 2>&1 || fail "B: $(cat "$tmp/b")"
grep -q 'generation 8' "$tmp/b" || fail "B: $(cat "$tmp/b")"
code=0; wait "$a" || code=$?
[ "$code" = 75 ] && grep -q 'WRITE 2 409' "$tmp/a" || fail "A ($code): $(cat "$tmp/a")"
"$FENCE" status --server "$S" --job "$job" | grep -q '"job":"inv/42","owner":"[^"]*","generation":8,"state":"completed"' || fail "status of $job"
[ "$(cut -d' ' -f1-4 "$tmp/up.log")" = "$(printf '/ledger inv/42 7 write\n/ledger inv/42 8 write')" ] || fail "ledger: $(cat "$tmp/up.log")"

# A claim's answer carries the last holder's checkpoint, with that holder's generation after
# the lease's own: the worker's token is its own generation (2), never the checkpoint's (1).
k1=$(printf '%064d' 1)
curl -fsS -o /dev/null -X POST -d "{\"owner\":\"first\",\"lease_key\":\"$k1\",\"ttl_ms\":10000}" "$S/v1/leases/resumed/claim"
curl -fsS -o /dev/null -X POST -d "{\"owner\":\"first\",\"generation\":1,\"lease_key\":\"$k1\",\"checkpoint\":\"step 3\"}" "$S/v1/leases/resumed/checkpoint"
curl -fsS -o /dev/null -X POST -d "{\"owner\":\"first\",\"generation\":1,\"lease_key\":\"$k1\"}" "$S/v1/leases/resumed/release"
run ledger resumed 10000 1 >"$tmp/resumed" 2>&1 || fail "resumed: $(cat "$tmp/resumed")"
grep -q 'holding resumed at generation 2' "$tmp/resumed" && grep -q '^/ledger resumed 2 write 1$' "$tmp/up.log" ||
  fail "resumed: the worker took the checkpoint's generation: $(cat "$tmp/resumed") $(cat "$tmp/up.log")"

# The bearer secret and the lease key are never among a process's arguments (any local user
# reads those): curl is wrapped to log the arguments of every call the worker makes.
mkdir -p "$tmp/bin"
printf '#!/bin/sh\nprintf "%%s\\n" "$*" >>"%s"\nexec "%s" "$@"\n' "$tmp/curl-args" "$(command -v curl)" >"$tmp/bin/curl"
chmod +x "$tmp/bin/curl"
PATH="$tmp/bin:$PATH" FENCE_AUTH_TOKEN=$'not-a-real-secret-0123456789\n' run ledger secrets 1500 2 >"$tmp/sec" 2>&1 ||
  fail "secrets: $(cat "$tmp/sec")"
grep -q '/v1/leases/secrets/claim' "$tmp/curl-args" || fail "the wrapper saw no claim: $(cat "$tmp/curl-args")"
! grep -qE 'lease_key|Bearer|not-a-real-secret' "$tmp/curl-args" || fail "a secret was an argument: $(cat "$tmp/curl-args")"
# One a header cannot carry is refused before anything is sent, and not repeated.
code=0; FENCE_AUTH_TOKEN=$'bad\x01not-a-real-secret' run ledger bad-secret 1500 1 >"$tmp/bad" 2>&1 || code=$?
[ "$code" = 1 ] && grep -q 'cannot carry' "$tmp/bad" && ! grep -q 'not-a-real-secret' "$tmp/bad" ||
  fail "a secret with a control character ($code): $(cat "$tmp/bad")"
code=0; FENCE_AUTH_TOKEN=$'  \n' run ledger blank-secret 1500 1 >"$tmp/blank" 2>&1 || code=$?
[ "$code" = 1 ] && grep -q 'only white space' "$tmp/blank" || fail "a blank secret ($code): $(cat "$tmp/blank")"

# A claim and a completion whose answers are lost (502, 503, 504: outcome unknown) are asked
# again with the same body: curl is wrapped to answer a run's first claim and first completion
# 503 itself, after passing them on to the server (decided there, the answer lost: only the
# same lease key gets that lease back, and the completion's retry finds it applied) or without
# (they never reached it), or to time out after passing them on (curl prints 000, exit 28). The worker must complete the job at generation 1, writing once.
mkdir -p "$tmp/lossy"
cat >"$tmp/lossy/curl" <<EOF
#!/bin/sh
out=; headers=; kind=; prev=
for a; do
  case \$prev in -o) out=\$a ;; -D) headers=\$a ;; esac
  case \$a in */claim) kind=claim ;; */complete) kind=complete ;; esac
  prev=\$a
done
if [ -n "\$kind" ] && mkdir "\$LOSSY_DIR/\$kind" 2>/dev/null; then
  [ "\$LOSSY" = refused ] || "$(command -v curl)" "\$@" >/dev/null
  # timed-out: no answer at all, as curl reports a --max-time that ran out (exit 28).
  [ "\$LOSSY" != timed-out ] || { printf 000; exit 28; }
  printf '{"type":"urn:fence:store-unavailable","title":"","status":503,"detail":"lost"}' >"\$out"
  [ -z "\$headers" ] || printf 'HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\n\r\n' >"\$headers"
  printf 503; exit 0
fi
exec "$(command -v curl)" "\$@"
EOF
chmod +x "$tmp/lossy/curl"
for mode in applied refused timed-out; do
  job=lossy-$mode; mkdir "$tmp/$job.lost"
  PATH="$tmp/lossy:$PATH" LOSSY=$mode LOSSY_DIR="$tmp/$job.lost" run ledger "$job" 10000 1 >"$tmp/$job" 2>&1 ||
    fail "$job: the worker failed: $(cat "$tmp/$job")"
  [ -d "$tmp/$job.lost/claim" ] && [ -d "$tmp/$job.lost/complete" ] || fail "$job: no claim or completion was answered 503"
  "$FENCE" status --server "$S" --job "$job" | grep -q '"generation":1,"state":"completed"' ||
    fail "$job: $("$FENCE" status --server "$S" --job "$job") $(cat "$tmp/$job")"
  [ "$(grep -c "^/ledger $job " "$tmp/up.log")" = 1 ] && grep -q "^/ledger $job 1 write 1$" "$tmp/up.log" ||
    fail "$job: ledger: $(cat "$tmp/up.log")"
done

# Each write takes 3 s (/slower) under a 6 s lease, renewed every 2 s: the revoke (after a
# status call) lands before the first renewal, and that renewal's refusal (some 2 s in) while
# write 1 is under way. The local deadline alone (5.4 s after the claim) would pass only
# during write 2: "lost during write 1" shows that the refused renewal cut it.
n=0
for job in 'a/b' 'a%b' 'a?b&c' 'a+b'; do n=$((n + 1))
  run slower "$job" 6000 3 >"$tmp/w$n" 2>&1 & w=$!
  ready "$tmp/w$n" "holding $job at generation 1"
  "$FENCE" status --server "$S" --job "$job" | grep -qF "\"job\":\"$job\"" || fail "status of $job"
  "$FENCE" revoke --server "$S" --job "$job" --reason test >/dev/null
  code=0; wait "$w" || code=$?
  [ "$code" = 75 ] && grep -q 'lease lost during write 1' "$tmp/w$n" || fail "$job ($code): the write under way was not cut at the refused renewal: $(cat "$tmp/w$n")"
  [ "$(grep -cF "/slower $job 1 " "$tmp/up.log")" = 1 ] || fail "$job: $(cat "$tmp/up.log")"
done

# Answers the real server never gives, from a scripted lease server: what it does depends on
# the job id (the path's), and it logs "action job lease_key generation" per request.
python3 -c 'import http.server as h, json, sys, time
seen = {}
class H(h.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(s):
        b = json.loads(s.rfile.read(int(s.headers["content-length"] or 0)) or b"{}")
        job, action = s.path.split("/")[-2:]
        n = seen[job, action] = seen.get((job, action), -1) + 1
        open(sys.argv[1] + ".log", "a").write("%s %s %s %s\n" % (action, job, b.get("lease_key"), b.get("generation")))
        ttl, gen, status, body = b.get("ttl_ms", 1000), 1, 200, None
        if action == "renew" and job == "hang-first-renewal" and n == 0 or action == "renew" and job == "long-ttl":
            time.sleep(30); return  # taken, never answered
        if action == "claim" and job == "huge-ttl": ttl = 10**20
        if action == "claim" and job == "tiny-ttl": ttl = 50
        if job == "long-ttl": ttl *= 10
        if action == "renew" and job == "other-generation": gen = 2
        if action == "claim" and job == "echo": body = json.dumps(b, separators=(",", ":"))
        if action == "claim" and job == "echo-cut": body = "{\"pad\":\"%s\",\"lease_key\":\"%s\"}" % ("x" * 270, b.get("lease_key"))
        if n == 0 and (action, job) in (("complete", "busy-complete"), ("claim", "gateway-408")):
            status = 408
            body = "request timeout" if job == "gateway-408" else json.dumps({"type": "urn:fence:body-timeout", "title": "", "status": 408, "detail": "late"}, separators=(",", ":"))
        if body is None:
            body = json.dumps({"job": job, "owner": b.get("owner"), "generation": gen, "state": "held" if action in ("claim", "renew") else "completed", "ttl_ms": ttl, "expires_at_ms": int(time.time() * 1000) + 1000}, separators=(",", ":"))
        s.send_response(status); s.send_header("retry-after", "0"); s.send_header("content-length", str(len(body))); s.end_headers(); s.wfile.write(body.encode())
    def log_message(s, *a): pass
srv = h.ThreadingHTTPServer(("127.0.0.1", 0), H); srv.daemon_threads = True; open(sys.argv[1], "w").write(str(srv.server_port)); srv.serve_forever()' "$tmp/fake" & pids+=($!)
ready "$tmp/fake" .
F=http://127.0.0.1:$(cat "$tmp/fake"); U=http://127.0.0.1:$(cat "$tmp/up")
fake() { SERVER=$F DESTINATION=$U/$1 JOB=$2 TTL_MS=$3 WRITES=$4 sh "$worker" >"$tmp/f.$2" 2>&1; }

# A renewal that is taken and never answered is given up after its attempt's time (a renewal
# interval, or half what is left) and asked again: the lease outlives it. A 6 s lease (renewed
# every 2 s, the hung attempt given up after 2 s, asked again 0.5 s later, some 0.9 s before the
# deadline) and seven 1 s writes that outlast it: given all the time left, the hung renewal
# would use up the lease during write 6.
fake slow hang-first-renewal 6000 7 || fail "hang-first-renewal: $(cat "$tmp/f.hang-first-renewal")"
[ "$(grep -c '^renew hang-first-renewal ' "$tmp/fake.log")" -ge 2 ] || fail "hang-first-renewal: $(cat "$tmp/fake.log")"

# A claim granted a TTL outside 100 ms to 24 h (one that overflows the shell's arithmetic, one
# too short to hold) is no grant: refused, nothing written. A renewal that grants another
# generation than the claim's is no grant either: the deadline stands, and the worker stops.
for job in huge-ttl tiny-ttl; do
  code=0; fake slow "$job" 1500 1 || code=$?
  [ "$code" = 1 ] && grep -q 'without a grant' "$tmp/f.$job" && ! grep -q "^/slow $job " "$tmp/up.log" ||
    fail "$job ($code): $(cat "$tmp/f.$job")"
done
code=0; fake slow other-generation 1500 3 || code=$?
[ "$code" = 75 ] && ! grep -q "^/slow other-generation 2 " "$tmp/up.log" ||
  fail "other-generation ($code): $(cat "$tmp/f.other-generation") $(grep other-generation "$tmp/up.log")"

# Every grant ten times the TTL asked, renewals never answered: the deadline still counts from
# the 1 s asked, so the first (1 s) write is cut; from 10 s, both writes would go out.
code=0; fake slow long-ttl 1000 2 || code=$?
[ "$code" = 75 ] && grep -q 'lease lost during write 1' "$tmp/f.long-ttl" || fail "long-ttl ($code): $(cat "$tmp/f.long-ttl")"

# A claim answered a gateway's 408 (the answer lost) is asked again with the same lease key; a
# completion answered the server's own 408 body-timeout (nothing applied) is asked again.
fake ledger gateway-408 10000 1 || fail "gateway-408: $(cat "$tmp/f.gateway-408")"
[ "$(grep '^claim gateway-408 ' "$tmp/fake.log" | cut -d' ' -f3 | uniq | wc -l)" = 1 ] &&
  [ "$(grep -c '^claim gateway-408 ' "$tmp/fake.log")" = 2 ] || fail "gateway-408: $(cat "$tmp/fake.log")"
fake ledger busy-complete 10000 1 || fail "busy-complete: $(cat "$tmp/f.busy-complete")"
[ "$(grep -c '^complete busy-complete ' "$tmp/fake.log")" = 2 ] || fail "busy-complete: $(cat "$tmp/fake.log")"

# A claim answered 200 with the request itself (an endpoint that echoes it): no grant, and the
# message quoting the answer never holds the lease key.
code=0; fake ledger echo 10000 1 || code=$?
echo_key=$(grep '^claim echo ' "$tmp/fake.log" | cut -d' ' -f3)
[ "$code" = 1 ] && [ -n "$echo_key" ] && grep -q 'lease_key' "$tmp/f.echo" && ! grep -qF "$echo_key" "$tmp/f.echo" ||
  fail "echo ($code): the lease key was quoted: $(cat "$tmp/f.echo")"
# The same with the key at the end of the 300 bytes quoted: none of it is shown (the cut left
# 7 characters of it, too few to be taken for a key, had it come before the redaction).
code=0; fake ledger echo-cut 10000 1 || code=$?
echo_key=$(grep '^claim echo-cut ' "$tmp/fake.log" | cut -d' ' -f3)
[ "$code" = 1 ] && [ -n "$echo_key" ] && grep -q 'lease_key' "$tmp/f.echo-cut" && ! grep -qF "$(printf %.7s "$echo_key")" "$tmp/f.echo-cut" ||
  fail "echo-cut ($code): the lease key was quoted: $(cat "$tmp/f.echo-cut")"

# A server that stops answering, with the worker's wall clock right and an hour off either
# way (libfaketime; the keeper measures on /proc/uptime, which it does not fake): writes of
# a second each under a 1.5 s lease; after the second write the server is SIGSTOPped. The
# local deadline (at most 1.35 s after the last renewal was sent) must stop the worker before
# a fifth write: at most two more go out after the stop, and it exits 75 without completing.
lib=
for l in /usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1 /usr/lib/faketime/libfaketime.so.1; do
  [ -e "$l" ] && lib=$l && break
done
[ -n "$lib" ] || fail "libfaketime is missing: apt-get install faketime"
for offset in none +1h -1h; do
  job="stopped/$offset"
  if [ "$offset" = none ]; then envs=(); else
    envs=(LD_PRELOAD="$lib" FAKETIME="$offset" FAKETIME_DONT_FAKE_MONOTONIC=1)
    skew=$(( $(env "${envs[@]}" date +%s) - $(date +%s) ))
    [ "${skew#-}" -gt 3500 ] || fail "$offset: faketime did not take (skew $skew s)"
  fi
  env ${envs[@]+"${envs[@]}"} SERVER=$S DESTINATION=$P/slow JOB=$job TTL_MS=1500 WRITES=6 \
    sh "$worker" >"$tmp/s$offset" 2>&1 & w=$!
  ready "$tmp/s$offset" 'WRITE 2 200'
  kill -STOP "${pids[1]}"
  code=0; wait "$w" || code=$?
  kill -CONT "${pids[1]}"
  [ "$code" = 75 ] && grep -qE 'lease lost; not sending|lease lost during write' "$tmp/s$offset" || fail "$job ($code): $(cat "$tmp/s$offset")"
  sent=$(grep -cF "/slow $job 1 " "$tmp/up.log" || true)
  [ "$sent" -ge 2 ] && [ "$sent" -le 4 ] || fail "$job: $sent writes reached the service (2 to 4 expected): $(cat "$tmp/s$offset")"
  "$FENCE" status --server "$S" --job "$job" | grep -q '"generation":1' || fail "status of $job"
  ! "$FENCE" status --server "$S" --job "$job" | grep -q '"state":"completed"' || fail "$job was completed"
done
echo "sh: ok: the worked example, lost claim and completion answers, a scripted server's hung renewal, bad TTLs and generations, 408s and echo, 4 encoded job ids, and a stopped server (clock right, +1h, -1h) with examples/sh/worker.sh"
