# moespec on CPU: the embedded torch engine and the shipped tiny MoE model pair, served over gRPC.
#
#   docker build -t moespec .
#   docker run --rm -p 127.0.0.1:50051:50051 -e MOESPEC_ADMIN_TOKEN="$(openssl rand -hex 32)" moespec
#   moespec client generate --server 127.0.0.1:50051 --prompt "def add(a, b):"
#
# Extra `moespec serve` flags go after the image name (they replace CMD), e.g.
#   docker run ... moespec --port 50051 --draft-length 3 --otel-endpoint http://collector:4317
# Telemetry follows the standard OTEL_* variables (off unless an exporter is configured).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# A C compiler: the engine builds its fused CPU kernels (service/engine/kernels/library.py) for the CPU it
# runs on at first start; without one it falls back to the slower eager step.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*

# CPU-only torch first, from PyTorch's own index: the default PyPI wheel would pull in CUDA (GBs).
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# Then the project (the gRPC stubs are committed under service/proto_gen, so no codegen here).
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY otel ./otel
COPY tuner ./tuner
COPY service ./service
# The fleet extra: the PostgreSQL driver a study shared by several tuner workers needs (docs/fleet.md).
RUN pip install ".[fleet]" \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin moespec

USER moespec
WORKDIR /home/moespec
EXPOSE 50051

# The standard grpc.health.v1 check, where the server's own flags say it listens: `moespec healthcheck`
# reads PID 1's command line (--host, --port, --tls-cert) and checks over TLS when the server serves
# TLS (verified against its own certificate, or MOESPEC_HEALTHCHECK_TLS_CA, for the name localhost or
# MOESPEC_HEALTHCHECK_TLS_SERVER_NAME). SERVING exits 0; NOT_SERVING (draining after SIGTERM) or no
# answer exits 1.
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["moespec", "healthcheck", "--timeout", "4"]

# SIGTERM (docker stop) drains: health goes NOT_SERVING and in-flight requests get --grace seconds;
# give docker stop a longer timeout than that (docker stop -t 15).
STOPSIGNAL SIGTERM
ENTRYPOINT ["moespec", "serve", "--host", "0.0.0.0"]
CMD ["--port", "50051"]
