# One image for every Tessera component: engine pods (`tessera engine`), the gateway
# (`tessera gateway`) and the operator (`tessera operator`). The pods pick the role by args.
#
#   docker build -t ghcr.io/tessera-ai/tessera:0.1.0 .
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t tessera:cpu .
FROM python:3.11-slim

# CUDA wheels by default (engine pods on GPUs); the CPU index makes a small image for kind/CI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C++ compiler: engine pods on CPUs build their attention kernels on first
# start (engine_pod/attention/cpu_ops, for the node's own CPU), into a
# directory the non-root user can write.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/tmp/tessera-torch-extensions

# torch first and on its own layer: it is most of the image and changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /opt/tessera
COPY pyproject.toml README.md ./
COPY tessera/ tessera/
COPY tessera_tools/ tessera_tools/
COPY engine_pod/ engine_pod/
COPY kv_store/ kv_store/
COPY gateway/ gateway/
COPY operator/ operator/
RUN pip install . && rm -rf build *.egg-info

# Non-root; the chart's operator and the operator's gateway and engine pods run as this uid
# (tessera_operator.pod_parts.RUN_AS_USER) with a read-only root filesystem: they write only
# to /tmp, an emptyDir, where TORCH_EXTENSIONS_DIR above points.
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin tessera
USER 10001
WORKDIR /home/tessera

ENTRYPOINT ["tessera"]
CMD ["--help"]
