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
#           data in /var/lib/fence/proxy; FENCE_UPSTREAM is the service it protects.
#   healthcheck: what the image's HEALTHCHECK runs: the /healthz of whichever of the two
#           this container started.
#
# Secrets are read as mounted: they must be readable by the image's user (uid 10001), and
# the server refuses an auth file or a signing key that group or others may read.
# FENCE_ETC and FENCE_STATE move /etc/fence and /var/lib/fence (for tests of this script).
set -eu
etc=${FENCE_ETC:-/etc/fence}
state=${FENCE_STATE:-/var/lib/fence}
fence=${FENCE_BIN:-/usr/local/bin/fence}
health="$state/.health"

default() { # NAME VALUE: export NAME=VALUE unless NAME is set
  eval "[ -n \"\${$1+x}\" ]" || export "$1=$2"
}

case "${1:-}" in
  server)
    default FENCE_LISTEN 0.0.0.0:7700
    default FENCE_DATA_DIR "$state/leases"
    default FENCE_AUTH_FILE "$etc/clients"
    default FENCE_TLS_CERT "$etc/tls/server.pem"
    default FENCE_TLS_KEY "$etc/tls/server-key.pem"
    [ -e "$etc/fence-signing.pem" ] && default FENCE_SIGNING_KEY "$etc/fence-signing.pem"
    port=${FENCE_LISTEN##*:}
    if [ -n "${FENCE_TLS_CERT:-}" ]; then
      printf 'https://localhost:%s %s/tls/ca.pem\n' "$port" "$etc" >"$health"
    else
      printf 'http://127.0.0.1:%s -\n' "$port" >"$health"
    fi
    ;;
  proxy)
    default FENCE_LISTEN 0.0.0.0:7800
    default FENCE_ADMIN_LISTEN 127.0.0.1:7801
    default FENCE_DATA_DIR "$state/proxy"
    [ -e "$etc/fence-verify.pem" ] && default FENCE_VERIFY_KEY "$etc/fence-verify.pem"
    printf 'http://127.0.0.1:%s -\n' "${FENCE_ADMIN_LISTEN##*:}" >"$health"
    ;;
  healthcheck)
    [ -r "$health" ] || { echo "fence healthcheck: no server or proxy started in this container" >&2; exit 1; }
    read -r url ca <"$health"
    if [ "$ca" = - ]; then exec "$fence" healthcheck --url "$url"; fi
    exec "$fence" healthcheck --url "$url" --ca-cert "$ca"
    ;;
esac
exec "$fence" "$@"
