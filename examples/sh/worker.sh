#!/bin/sh
# A fence worker in POSIX sh with curl, written from docs/protocol.md ("Writing a worker in
# any language"). It claims a job, renews it in the background, sends each write with
# X-Fencing-Job and X-Fencing-Token, stops as soon as it cannot be sure it still holds the
# lease, and completes the job at the end.
#
#   SERVER=http://127.0.0.1:7700 DESTINATION=http://127.0.0.1:7800/reports JOB=nightly \
#     TTL_MS=30000 WRITES=3 sh worker.sh
#
# The deadline is measured on the monotonic clock (/proc/uptime, Linux) from the moment the
# claim or renewal was sent: send time + TTL - margin (10% of the TTL the server granted, at
# least 50 ms; never counted from more than TTL_MS). A renewal attempt gets a renewal
# interval, or half what is left of the lease when longer; one that gets no answer in that
# time is asked again.
# A claim or completion whose answer is lost (none, or 502, 503, 504, a gateway's 408: outcome
# unknown) or that the server did not get whole in time (408 body-timeout) is asked
# again with the same body, at most 5 times, after its Retry-After (at most 5 s) or 1 s.
# A write still under way when the deadline passes (or a renewal is refused) is cut: it may
# have reached the destination, its outcome is unknown ("WRITE N cut").
# Exit codes: 0 done, 3 no lease, 75 lease lost, 1 anything else. Needs curl and od.
# STALL_BEFORE_SEND=S pauses the whole worker for S seconds before its second write, as a GC
# pause would: that write then carries a stale token, and a fenced destination refuses it.
set -eu
: "${SERVER:?}" "${DESTINATION:?}" "${JOB:?}"
LC_ALL=C; export LC_ALL
case $JOB in *[!!-~]*) echo "worker: job id $JOB: only visible ASCII (0x21 to 0x7E) is allowed" >&2; exit 1 ;; esac
TTL_MS=${TTL_MS:-30000}; WRITES=${WRITES:-3}
state=$(mktemp -d); trap 'kill "$keeper" 2>/dev/null || true; rm -rf "$state"' EXIT
keeper=
# The bearer secret and the lease key go to curl in files of this private directory, never
# as arguments: any local user can read a process's arguments (ps, /proc/<pid>/cmdline).
umask 077
auth=
# White space around the secret (an environment variable's newline) is no part of it; what is
# left must be visible ASCII to go in a header, and an error never repeats it.
tok=${FENCE_AUTH_TOKEN:-}
tok=${tok#"${tok%%[![:space:]]*}"}; tok=${tok%"${tok##*[![:space:]]}"}
if [ -z "$tok" ] && [ -n "${FENCE_AUTH_TOKEN:-}" ]; then
  echo "worker: FENCE_AUTH_TOKEN is only white space" >&2; exit 1
fi
case $tok in
  *[!!-~]*) echo "worker: FENCE_AUTH_TOKEN holds a character a header cannot carry (not shown)" >&2; exit 1 ;;
esac
if [ -n "$tok" ]; then
  printf 'Authorization: Bearer %s\n' "$tok" >"$state/auth"; auth=@$state/auth
fi

now_ms() { read -r up _ </proc/uptime; echo "${up%.*}${up#*.}0"; } # 10 ms resolution
# 32 random bytes in hex (hex digits are base64url characters too): the lease key, the proof
# that the lease is ours.
key=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
owner="$(hostname)-$$-sh"

# field NAME JSON: a string (escapes kept) or number field of the answer's top level: the
# first "NAME": in it (the server writes its own fields before any nested object, such as a
# claim's "checkpoint", whose "generation" is the saving holder's, not this lease's; inside a
# string a quote is escaped, so "NAME": there is never matched).
field() {
  case $2 in *"\"$1\":"*) ;; *) return 0 ;; esac
  rest=${2#*"\"$1\":"}
  case $rest in
    \"*) printf '%s' "$rest" | sed -n 's/^"\(\([^"\\]*\(\\.\)*\)*\)".*/\1/p' ;;
    *) printf '%s' "${rest%%[!0-9]*}" ;;
  esac
}

# The job id percent-encoded for the URL path: every byte but A-Z a-z 0-9 - . _ ~ as %XX.
encode() {
  s=$1
  while [ -n "$s" ]; do
    rest=${s#?}; c=${s%"$rest"}; s=$rest
    case $c in
      [A-Za-z0-9._~-]) printf '%s' "$c" ;;
      *) printf '%%%02X' "'$c" ;;
    esac
  done
}
job_path=$(encode "$JOB")

# call ACTION BODY [WITHIN_MS]: POST to the lease API within WITHIN_MS (default: the TTL and
# a second); prints the status, the answer in $state/answer (its headers in
# $state/headers.ACTION). (printf is the shell's own: the body, with the lease key, is never an
# argument of a process.)
call() {
  within=${3:-$(( TTL_MS + 1000 ))}; [ "$within" -ge 100 ] || within=100
  printf '%s' "$2" >"$state/body.$1"
  : >"$state/headers.$1"
  # A failed exchange (no connection, cut, timed out: curl prints 000 or a status whose body
  # did not arrive whole) is no answer: 000.
  if code=$(curl -sS -o "$state/answer" -D "$state/headers.$1" -w '%{http_code}' -X POST \
    -H 'content-type: application/json' ${auth:+-H "$auth"} \
    --max-time "$(( within / 1000 )).$(( within % 1000 / 100 ))" \
    --data "@$state/body.$1" "$SERVER/v1/leases/$job_path/$1"); then
    echo "$code"
  else
    echo 000
  fi
}

# retried ACTION BODY: call, asked again with the same body while its answer is lost (none, or
# 502, 503 or 504, or a gateway's 408: whether it took effect is unknown) or the server did not
# get it whole in time (its own 408 body-timeout: nothing applied), at most 5 times and within the TTL of
# the first try, after the answer's Retry-After (whole seconds, at most 5) or else 1 s. A claim
# asked again with the same owner and key gets the same lease back; a completion that took
# effect answers 409 lease-lost naming this owner and generation (see the end). Sets $status,
# $sent (the monotonic send time of the last try) and $tries.
retried() {
  tries=0; first=$(now_ms)
  while :; do
    tries=$((tries + 1)); sent=$(now_ms)
    status=$(call "$1" "$2")
    case $status in 000|408|502|503|504) ;; *) return 0 ;; esac
    [ "$tries" -lt 5 ] || return 0
    pause=$(sed -n 's/^[Rr][Ee][Tt][Rr][Yy]-[Aa][Ff][Tt][Ee][Rr]: *\([0-9][0-9]*\).*/\1/p' "$state/headers.$1" | head -n 1)
    case $pause in ''|*[!0-9]*) pause=1 ;; esac
    [ "${#pause}" -le 1 ] && [ "$pause" -le 5 ] || pause=5
    [ $(( $(now_ms) + pause * 1000 )) -lt $(( first + TTL_MS )) ] || return 0
    echo "worker: $1 answered $status; asking again in $pause s" >&2
    sleep "$pause"
  done
}

# grant SENT_MS [GENERATION]: records the deadline and token of the answer in $state/answer;
# fails, and records nothing, when the answer is no grant: no whole-number generation (or not
# GENERATION, a renewal's), no TTL of 100 ms to 24 h (as the other clients: a huge one would
# overflow the shell's arithmetic, or put the deadline years away).
grant() {
  a=$(cat "$state/answer")
  ttl=$(field ttl_ms "$a"); gen=$(field generation "$a"); tok=$(field token "$a")
  case $ttl in ''|*[!0-9]*) return 1 ;; esac
  [ "${#ttl}" -le 8 ] && [ "$ttl" -ge 100 ] && [ "$ttl" -le 86400000 ] || return 1
  case $gen in ''|*[!0-9]*) return 1 ;; esac
  [ -z "${2:-}" ] || [ "$gen" = "$2" ] || return 1
  # Never counted from more than was asked: a server (or something posing as one) that grants
  # more cannot move the deadline, nor the renewals, past what the worker asked to hold.
  [ "$ttl" -le "$TTL_MS" ] || ttl=$TTL_MS
  echo "$gen" >"$state/generation.next" && mv "$state/generation.next" "$state/generation"
  echo "$ttl" >"$state/ttl.next" && mv "$state/ttl.next" "$state/ttl"
  echo "${tok:-$gen}" >"$state/token.next" && mv "$state/token.next" "$state/token"
  margin=$(( ttl / 10 )); [ "$margin" -ge 50 ] || margin=50
  echo $(( $1 + ttl - margin )) >"$state/deadline.next" && mv "$state/deadline.next" "$state/deadline"
}

# quoted FILE: an answer as an error message may quote it: its first 300 bytes, any lease_key
# value replaced (an endpoint that echoes the request would otherwise put the lease's proof in
# the worker's log), before the cut: a key cut short at the end would escape the replacement.
quoted() {
  sed 's/\(lease_key[^A-Za-z0-9_-]\{0,8\}\)[A-Za-z0-9_-]\{8,\}/\1<redacted>/g' "$1" | head -c 300
}

retried claim "{\"owner\":\"$owner\",\"lease_key\":\"$key\",\"ttl_ms\":$TTL_MS}"
if [ "$status" != 200 ]; then
  echo "worker: no lease on $JOB: $(field detail "$(quoted "$state/answer")")" >&2; exit 3
fi
grant "$sent" || { echo "worker: the claim of $JOB was answered 200 without a grant: $(quoted "$state/answer")" >&2; exit 1; }
echo "worker: holding $JOB at generation $(cat "$state/generation")" >&2

# The keeper: renews every third of the TTL the server granted (it may grant less than asked,
# up to its --max-ttl), and again after a twelfth when a renewal got no answer; marks the
# lease lost when refused.
(
  every=$(( $(cat "$state/ttl") / 3 ))
  while :; do
    [ "$every" -ge 100 ] || every=100 # never a busy loop
    sleep "$(( every / 1000 )).$(( every % 1000 / 100 ))"
    [ "$(now_ms)" -lt "$(cat "$state/deadline")" ] || exit 0
    sent=$(now_ms)
    body="{\"owner\":\"$owner\",\"generation\":$(cat "$state/generation"),\"lease_key\":\"$key\",\"ttl_ms\":$TTL_MS}"
    # Each attempt has its own time (as the Rust client): a renewal interval, or half the time
    # left when longer, never past the deadline. A connection that takes the request and never
    # answers is then abandoned and the renewal asked again, not the lease lost.
    left=$(( $(cat "$state/deadline") - sent )); attempt=$(( $(cat "$state/ttl") / 3 ))
    [ "$attempt" -ge $(( left / 2 )) ] || attempt=$(( left / 2 ))
    [ "$attempt" -le "$left" ] || attempt=$left
    case $(call renew "$body" "$attempt") in
      # Granted, but answered after the deadline: the loss stands (the main loop may
      # already have stopped on it), so the lease is not taken up again. A 200 that is no
      # grant (cut, garbled) is no answer: the deadline stands; ask again soon.
      200) [ "$(now_ms)" -lt "$(cat "$state/deadline")" ] || exit 0
           if grant "$sent" "$(cat "$state/generation")"; then every=$(( $(cat "$state/ttl") / 3 )); else every=$(( $(cat "$state/ttl") / 12 )); fi ;;
      # Written whole or not at all (a reader must never find the file empty).
      403|409|410) echo 0 >"$state/deadline.next" && mv "$state/deadline.next" "$state/deadline"; exit 0 ;;
      *) every=$(( $(cat "$state/ttl") / 12 )) ;; # no answer: the deadline stands; ask again soon
    esac
  done
) &
keeper=$!

n=0
while [ "$n" -lt "$WRITES" ]; do
  n=$((n + 1))
  deadline=$(cat "$state/deadline")
  case $deadline in ''|*[!0-9]*) deadline=0 ;; esac # unreadable: take it as lost
  if [ "$(now_ms)" -ge "$deadline" ]; then
    echo "worker: lease lost; not sending" >&2; exit 75
  fi
  token=$(cat "$state/token")
  if [ "$n" = 2 ] && [ -n "${STALL_BEFORE_SEND:-}" ]; then
    # A whole-worker pause (GC, SIGSTOP) after the last look at the deadline, one no check
    # of the worker's can see: its write goes out as soon as it wakes (no watch below).
    kill -STOP "$keeper"; sleep "$STALL_BEFORE_SEND"; kill -CONT "$keeper"; watch=
  else
    watch=1
  fi
  # The status even when curl failed after it (the answer's body is not read); else 000.
  # The write takes at most 30 s, and is cut the moment the deadline passes (the keeper
  # moves it on each renewal, and to 0 on a refused one): from then on this worker cannot be
  # sure it holds the lease. A cut write may have reached the destination: its outcome is
  # unknown.
  # (curl itself in the background, so that the kill below reaches it.)
  curl -sS -o /dev/null -w '%{http_code}' --max-time 30 -X POST -H "X-Fencing-Job: $JOB" \
    -H "X-Fencing-Token: $token" --data "write $n" "$DESTINATION" >"$state/code" &
  writer=$!
  cut=
  while [ -n "$watch" ] && kill -0 "$writer" 2>/dev/null; do
    deadline=$(cat "$state/deadline")
    case $deadline in ''|*[!0-9]*) deadline=0 ;; esac
    if [ "$(now_ms)" -ge "$deadline" ]; then cut=1; kill "$writer" 2>/dev/null || true; break; fi
    sleep 0.02
  done
  wait "$writer" || true
  if [ -n "$cut" ]; then
    echo "WRITE $n cut"; echo "worker: lease lost during write $n; its outcome is unknown" >&2; exit 75
  fi
  code=$(cat "$state/code")
  case $code in [0-9][0-9][0-9]) ;; *) code=000 ;; esac
  echo "WRITE $n $code"
  case $code in
    2??) ;;
    409) exit 75 ;; # a newer holder exists: stop, do not complete
    *) exit 1 ;;
  esac
done
kill "$keeper" 2>/dev/null || true
generation=$(cat "$state/generation")
retried complete "{\"owner\":\"$owner\",\"generation\":$generation,\"lease_key\":\"$key\"}"
if [ "$status" = 409 ] && [ "$tries" -gt 1 ]; then
  # An earlier try took effect and its answer was lost: the job is completed by this owner at
  # this generation (a completion is the only refusal that leaves both in place).
  a=$(cat "$state/answer")
  if [ "$(field owner "$a")" = "$owner" ] && [ "$(field generation "$a")" = "$generation" ]; then
    status=200
  fi
fi
[ "$status" = 200 ] || exit 75
echo "worker: done; the job is completed" >&2
exit 0
