# fence in a container: built with the `dist` profile, run as a user of its own (uid 10001).
#
#   docker build -t fence .
#   fence keygen --out ./etc && fence tls init ./etc/tls --name leases.internal
#   mv ./etc/tls/ca-key.pem ./ca-key.pem   # not into the container: it signs certificates
#   (umask 077 && printf 'billing %s inv-*\n' "$(head -c 32 /dev/urandom | base64)" > ./etc/clients)
#   sudo chown -R 10001 ./etc
#   docker run -d --stop-timeout 60 -p 7700:7700 -v fence-leases:/var/lib/fence -v "$PWD/etc:/etc/fence:ro" fence
#   docker run -d --stop-timeout 60 -p 7800:7800 -e FENCE_UPSTREAM=http://billing:8080 \
#     -v fence-proxy:/var/lib/fence -v "$PWD/etc/fence-verify.pem:/etc/fence/fence-verify.pem:ro" fence proxy
#   docker run --rm fence claim --help                       # or any other fence command
#
# --stop-timeout 60: on SIGTERM fence drains for up to 30 s and closes its database within
# 20 s more; docker's default of 10 s would SIGKILL it first (nothing acknowledged is lost,
# but requests in flight are cut). contrib/docker/entrypoint.sh sets each role's defaults as FENCE_* variables (any of them
# can be given with -e instead): the server on 0.0.0.0:7700 with TLS and the auth file from
# /etc/fence (fence refuses to listen beyond loopback without both), signing with
# /etc/fence/fence-signing.pem when mounted; the proxy on 0.0.0.0:7800, its admin port on the
# container's loopback (7801, for the health check), verifying with
# /etc/fence/fence-verify.pem when mounted. A proxy given FENCE_ADMIN_AUTH_FILE needs one of
# that file's secrets in /etc/fence/health.secret (or FENCE_HEALTH_AUTH_TOKEN_FILE) for its
# health check, and with FENCE_TLS_CERT the check trusts /etc/fence/tls/ca.pem (or
# FENCE_HEALTH_CA_CERT). The mounted files must be readable by uid 10001.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --locked --profile dist -p fence --bin fence

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/fence --create-home --shell /usr/sbin/nologin fence
COPY --from=build /src/target/dist/fence /usr/local/bin/fence
COPY contrib/docker/entrypoint.sh /usr/local/bin/fence-entrypoint
USER fence
WORKDIR /var/lib/fence
VOLUME ["/var/lib/fence"]
EXPOSE 7700 7800
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["/usr/local/bin/fence-entrypoint", "healthcheck"]
ENTRYPOINT ["/usr/local/bin/fence-entrypoint"]
CMD ["server"]
