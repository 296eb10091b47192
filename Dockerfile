# kvmesh container image: the `kvmesh` CLI (worker, router, ray, up, ...) as entrypoint.
#   CPU (default):  docker build -t kvmesh:0.1.0 .
#   CUDA:           docker build -t kvmesh:0.1.0-cuda --build-arg FLAVOR=cuda .
# Both stages install through scripts/setup.sh, the script `make setup` runs, so the image
# and a developer machine install the same things the same way. The k8s/ manifests run
# it as uid 10001 with a read-only root filesystem (writable: /tmp and the disk tier).
ARG FLAVOR=cpu
ARG CPU_BASE=python:3.11-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

# --- base images per flavor: which torch build setup.sh installs ----------------------
FROM ${CPU_BASE} AS base-cpu
ENV TORCH_SPEC="torch==2.13.0+cpu" \
    PIP_EXTRA_INDEX_URL="https://download.pytorch.org/whl/cpu"

FROM ${CUDA_BASE} AS base-cuda
# PyPI's Linux torch wheel is the CUDA build
ENV TORCH_SPEC="torch==2.13.0" \
    DEBIAN_FRONTEND=noninteractive

# --- build: compiler, headers, a virtualenv with kvmesh installed (not editable) --------
FROM base-${FLAVOR} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/kvmesh
COPY pyproject.toml setup.py README.md ./
COPY scripts/setup.sh scripts/setup.sh
COPY cache_store/ cache_store/
COPY workers/ workers/
COPY services/ services/
COPY proto/ proto/
COPY bench/ bench/
RUN ./scripts/setup.sh --runtime

# --- runtime: run-time Debian packages, the virtualenv, a non-root user ------------------
FROM base-${FLAVOR} AS runtime
WORKDIR /opt/kvmesh
COPY scripts/setup.sh scripts/setup.sh
RUN ./scripts/setup.sh --runtime --apt-only && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --no-create-home --home-dir /tmp \
       --shell /usr/sbin/nologin kvmesh
COPY --from=build /opt/kvmesh/.venv /opt/kvmesh/.venv
ENV PATH="/opt/kvmesh/.venv/bin:${PATH}" \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /tmp
# router gRPC, worker gRPC, metrics (docs/DEPLOY.md lists every port)
EXPOSE 50050 50051 9400
ENTRYPOINT ["kvmesh"]
CMD ["--help"]
