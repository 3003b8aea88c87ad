# fence in a container: built with the `dist` profile, run as a user of its own.
#
#   docker build -t fence .
#   docker run --rm -p 7700:7700 -v fence-leases:/var/lib/fence \
#     -v /etc/fence:/etc/fence:ro fence                     # the lease server (the default)
#   docker run --rm fence proxy --help                       # or any other fence command
#
# The default command serves the lease API on all interfaces, so it needs TLS and an auth
# file (fence refuses to listen beyond loopback without one): mount them at /etc/fence.
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
USER fence
WORKDIR /var/lib/fence
VOLUME ["/var/lib/fence"]
EXPOSE 7700 7800 7801
ENTRYPOINT ["/usr/local/bin/fence"]
CMD ["server", "--listen", "0.0.0.0:7700", "--data-dir", "/var/lib/fence/leases", "--auth-file", "/etc/fence/clients", "--tls-cert", "/etc/fence/tls/cert.pem", "--tls-key", "/etc/fence/tls/key.pem"]
