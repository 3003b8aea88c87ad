#!/bin/sh
# The fence image's entrypoint: `server` or `proxy` with the defaults of a container, set as
# FENCE_* variables only where the operator set none (every flag has one: fence SUB --help),
# then `fence "$@"`. Any other command runs as it is (`docker run fence claim ...`).
#
#   server: listens on 0.0.0.0:7700 with TLS (/etc/fence/tls/server.pem, server-key.pem, as
#           `fence tls init /etc/fence/tls` makes them) and the auth file /etc/fence/clients;
#           signs tokens with /etc/fence/fence-signing.pem when it is there; data in
#           /var/lib/fence/leases.
#   proxy:  listens on 0.0.0.0:7800, its admin port on 127.0.0.1:7801 (inside the container:
#           the health check's); verifies with /etc/fence/fence-verify.pem when it is there;
#           data in /var/lib/fence/proxy; FENCE_UPSTREAM is the service it protects. With
#           FENCE_TLS_CERT the admin port speaks TLS too, and the health check asks
#           https://localhost (the certificate must name localhost, as `fence tls init`'s
#           do) trusting FENCE_HEALTH_CA_CERT (default /etc/fence/tls/ca.pem, for the server
#           too); with FENCE_ADMIN_AUTH_FILE
#           it sends the secret in FENCE_HEALTH_AUTH_TOKEN_FILE (default
#           /etc/fence/health.secret, one of the admin auth file's secrets), and the proxy
#           does not start without one.
#   healthcheck: what the image's HEALTHCHECK runs: the /healthz of whichever of the two
#           this container started.
#
# The health check follows --listen, --admin-listen, --tls-cert and --admin-auth-file given on
# the command line (`docker run fence server --listen 0.0.0.0:7701`) as well as their FENCE_*
# variables. FENCE_TLS_CERT= (empty) runs the role without TLS (behind a sidecar that ends it);
# the server then needs FENCE_INSECURE_NO_TLS=true off loopback, as fence server --help says.
#
# Secrets are read as mounted: they must be readable by the image's user (uid 10001), and
# the server refuses an auth file or a signing key that group or others may read.
# FENCE_ETC and FENCE_STATE move /etc/fence and /var/lib/fence (for tests of this script).
set -eu
etc=${FENCE_ETC:-/etc/fence}
state=${FENCE_STATE:-/var/lib/fence}
fence=${FENCE_BIN:-/usr/local/bin/fence}
health="$state/.health"

probe() { # URL CA TOKEN_FILE ('-': none): what `healthcheck` asks, one a line (paths may hold spaces)
  printf '%s\n%s\n%s\n' "$1" "$2" "$3" >"$health"
}

default() { # NAME VALUE: export NAME=VALUE unless NAME is set
  eval "[ -n \"\${$1+x}\" ]" || export "$1=$2"
}

flag() { # NAME ARGS...: the last value of --NAME (as --NAME VALUE or --NAME=VALUE) in ARGS
  name=$1 value= take=
  shift
  for a in "$@"; do
    if [ -n "$take" ]; then value=$a take=; continue; fi
    case "$a" in
      "--$name") take=1 ;;
      "--$name="*) value=${a#--"$name"=} ;;
    esac
  done
  printf '%s' "$value"
}

plain_if_empty() { # FENCE_TLS_CERT set empty means plain HTTP: fence takes no empty value
  if [ -z "${FENCE_TLS_CERT:-}" ]; then unset FENCE_TLS_CERT FENCE_TLS_KEY; fi
}

case "${1:-}" in
  server)
    default FENCE_LISTEN 0.0.0.0:7700
    default FENCE_DATA_DIR "$state/leases"
    default FENCE_AUTH_FILE "$etc/clients"
    default FENCE_TLS_CERT "$etc/tls/server.pem"
    default FENCE_TLS_KEY "$etc/tls/server-key.pem"
    [ -e "$etc/fence-signing.pem" ] && default FENCE_SIGNING_KEY "$etc/fence-signing.pem"
    plain_if_empty
    # What the command line says wins over the environment, for the health check too.
    listen=$(flag listen "$@") tls=$(flag tls-cert "$@")
    port=${listen:-$FENCE_LISTEN}
    port=${port##*:}
    if [ -n "${tls:-${FENCE_TLS_CERT:-}}" ]; then
      probe "https://localhost:$port" "${FENCE_HEALTH_CA_CERT:-$etc/tls/ca.pem}" -
    else
      probe "http://127.0.0.1:$port" - -
    fi
    ;;
  proxy)
    default FENCE_LISTEN 0.0.0.0:7800
    default FENCE_ADMIN_LISTEN 127.0.0.1:7801
    default FENCE_DATA_DIR "$state/proxy"
    [ -e "$etc/fence-verify.pem" ] && default FENCE_VERIFY_KEY "$etc/fence-verify.pem"
    plain_if_empty
    admin=$(flag admin-listen "$@") tls=$(flag tls-cert "$@") auth=$(flag admin-auth-file "$@")
    port=${admin:-$FENCE_ADMIN_LISTEN}
    port=${port##*:} token=-
    if [ -n "${auth:-${FENCE_ADMIN_AUTH_FILE:-}}" ]; then
      token=${FENCE_HEALTH_AUTH_TOKEN_FILE:-$etc/health.secret}
      [ -r "$token" ] && [ -s "$token" ] || {
        echo "fence-entrypoint: the admin listener needs a secret (FENCE_ADMIN_AUTH_FILE), and the health check has none to send: put one of that file's secrets in $token, or name another file in FENCE_HEALTH_AUTH_TOKEN_FILE" >&2
        exit 2
      }
    fi
    if [ -n "${tls:-${FENCE_TLS_CERT:-}}" ]; then
      probe "https://localhost:$port" "${FENCE_HEALTH_CA_CERT:-$etc/tls/ca.pem}" "$token"
    else
      probe "http://127.0.0.1:$port" - "$token"
    fi
    ;;
  healthcheck)
    [ -r "$health" ] || { echo "fence healthcheck: no server or proxy started in this container" >&2; exit 1; }
    url= ca= token=
    { IFS= read -r url && IFS= read -r ca && IFS= read -r token; } <"$health" || true
    [ -n "$url" ] || { echo "fence healthcheck: $health names no URL; restart the container" >&2; exit 1; }
    set -- healthcheck --url "$url"
    [ "${ca:--}" = - ] || set -- "$@" --ca-cert "$ca"
    [ "${token:--}" = - ] || set -- "$@" --auth-token-file "$token"
    exec "$fence" "$@"
    ;;
esac
exec "$fence" "$@"
