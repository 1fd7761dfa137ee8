# syntax=docker/dockerfile:1
#
# Build: docker build --build-arg CIFPOOL_GIT_SHA=$(git rev-parse --short=12 HEAD) -t cifpool .
# Run:   docker run -p 8080:8080 \
#          -e CIFPOOL_DATABASE__URL='postgres://cifpool:…@db:5432/cifpool' \
#          -e CIFPOOL_SECURITY__ADMIN_TOKEN='…at least 16 characters…' \
#          -v "$PWD/cifpool.toml:/etc/cifpool/cifpool.toml:ro" \
#          -v "$PWD/master.key:/run/secrets/cifpool-master-key:ro" \
#          cifpool
#
# The image carries no configuration and no key: both are mounted (see docs/OPERATIONS.md). Without a
# file at CIFPOOL_CONFIG the process refuses to start, on purpose: the compiled-in defaults use "noop"
# notification providers that silently send nothing. Every subcommand but `keygen` reads that file too;
# `keygen` reads nothing:  docker run --rm cifpool keygen > master.key
# The build and runtime stages must use the same Debian release (the binary links against its glibc).
ARG RUST_VERSION=1.95
ARG DEBIAN_RELEASE=bookworm

############################################################################################################
FROM rust:${RUST_VERSION}-${DEBIAN_RELEASE} AS build
WORKDIR /src

# 1. Dependency layer, cached until the manifests or Cargo.lock change. Cargo needs every workspace member
#    and every target a manifest declares to exist, so stubs stand in for src/lib.rs, src/main.rs and the
#    tools crate (its sources are never built here: only the service, `-p cifpool`). The stubs reference
#    none of the files the real crate embeds at compile time (config/default.toml via include_str!,
#    migrations/ via sqlx::migrate!), so they are not needed here. The service's own stub artifacts are
#    then deleted, so the real sources below are always rebuilt, whatever their timestamps.
COPY Cargo.toml Cargo.lock ./
COPY tools/Cargo.toml ./tools/
RUN mkdir -p src tools/src tools/benches \
 && echo 'fn main() {}' > src/main.rs \
 && : > src/lib.rs \
 && echo 'fn main() {}' > tools/src/main.rs \
 && : > tools/src/lib.rs \
 && echo 'fn main() {}' > tools/benches/feistel.rs \
 && cargo build --release --locked -p cifpool --bin cifpool \
 && rm -rf src \
      target/release/cifpool target/release/cifpool.d \
      target/release/deps/cifpool-* target/release/deps/libcifpool-* \
      target/release/.fingerprint/cifpool-*

# 2. The service itself: only what its build reads, so editing docs, deploy/, tests/ or tools/ does not
#    rebuild (the tools' stubs from step 1 stay, for the workspace manifest).
#    build.rs records the commit for cifpool_build_info: there is no .git in the build context, so pass
#    it: docker build --build-arg CIFPOOL_GIT_SHA=$(git rev-parse --short=12 HEAD) .
ARG CIFPOOL_GIT_SHA=unknown
COPY build.rs ./
COPY src ./src
COPY migrations ./migrations
COPY config/default.toml ./config/default.toml
RUN cargo build --release --locked -p cifpool --bin cifpool \
 && install -D -m 0755 target/release/cifpool /out/cifpool

############################################################################################################
FROM debian:${DEBIAN_RELEASE}-slim AS runtime

# curl is only for the HEALTHCHECK below (cifpool has no health-check subcommand). Debian package versions
# are not pinned: the release's security updates should land on every rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 cifpool \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin cifpool

COPY --from=build /out/cifpool /usr/local/bin/cifpool

# Configuration comes from outside: CIFPOOL_CONFIG (a mounted TOML file, e.g. a Kubernetes ConfigMap),
# secrets from mounted files named by CIFPOOL_DATABASE__URL_FILE, CIFPOOL_SECURITY__ADMIN_TOKEN_FILE, … (or
# the plain variables) and the master key from a mounted file. Environment variables win over the file, so the listen address and log format
# below hold whatever the file says. 0.0.0.0: inside a container, 127.0.0.1 is unreachable from outside.
ENV CIFPOOL_CONFIG=/etc/cifpool/cifpool.toml \
    CIFPOOL_SERVER__LISTEN=0.0.0.0:8080 \
    CIFPOOL_LOG__FORMAT=json \
    CIFPOOL_SECURITY__MASTER_KEY_FILE=/run/secrets/cifpool-master-key

# Numeric user, so Kubernetes' runAsNonRoot can verify it. Nothing is written to the filesystem when
# database.url is set (the embedded Postgres is for development only and is not in this image).
USER 10001:10001
EXPOSE 8080

# /healthz is liveness only (it does not touch the database); readiness is /readyz.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["curl", "-fsS", "-o", "/dev/null", "--max-time", "2", "http://127.0.0.1:8080/healthz"]

# cifpool handles SIGTERM itself (graceful drain, server.shutdown_grace); it runs as PID 1 and starts no
# child processes in this set-up, so no init is needed.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/cifpool"]
CMD ["serve"]
