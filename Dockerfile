# syntax=docker/dockerfile:1
# Build: docker build -t cifpool .
# Run:   docker run -e CIFPOOL_DATABASE__URL=postgres://… -e CIFPOOL_SECURITY__ADMIN_TOKEN=… \
#          -v /path/to/master.key:/run/secrets/cifpool-master-key:ro -p 8080:8080 cifpool

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependency layer: build against stub sources so this layer is cached until Cargo.toml/Cargo.lock change.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches \
 && echo 'fn main() {}' > src/main.rs && echo '' > src/lib.rs \
 && cargo build --release --locked --bin cifpool || true
COPY . .
RUN touch src/main.rs src/lib.rs && cargo build --release --locked --bin cifpool

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cifpool
COPY --from=build /src/target/release/cifpool /usr/local/bin/cifpool
USER 10001
ENV CIFPOOL_SERVER__LISTEN=0.0.0.0:8080 \
    CIFPOOL_LOG__FORMAT=json \
    CIFPOOL_SECURITY__MASTER_KEY_FILE=/run/secrets/cifpool-master-key
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=2s --start-period=20s --retries=3 \
  CMD curl -fsS http://127.0.0.1:8080/healthz || exit 1
ENTRYPOINT ["/usr/local/bin/cifpool"]
CMD ["serve"]
