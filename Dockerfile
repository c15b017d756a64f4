# Two images from one file, one per install of pyproject.toml:
#   engine:        engine pods (`tessera engine`): torch, the kernels' compiler, `pip install .[engine]`.
#   control-plane: the gateway (`tessera gateway`) and the operator (`tessera operator`): `pip install .`,
#                  no torch, no compiler.
# The pods pick the role by args; the operator gives each workload its image (spec.image for engine
# pods, spec.gateway.image for the gateway) and the chart runs the operator on the control-plane image.
#
#   docker build --target engine -t ghcr.io/tessera-ai/tessera:0.1.0 .
#   docker build --target control-plane -t ghcr.io/tessera-ai/tessera-control-plane:0.1.0 .
#   docker build --target engine --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t tessera:cpu .
# Without --target the build stops at the last stage, engine (the one image there used to be).

# The sources, once: both images install from this copy.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY tessera/ /src/tessera/
COPY tessera_tools/ /src/tessera_tools/
COPY engine_pod/ /src/engine_pod/
COPY kv_store/ /src/kv_store/
COPY gateway/ /src/gateway/
COPY operator/ /src/operator/

# What both images share: the interpreter, pip's settings and the non-root user. The chart's
# operator and the operator's gateway and engine pods run as this uid
# (tessera_operator.pod_parts.RUN_AS_USER) with a read-only root filesystem: they write only
# to /tmp, an emptyDir.
FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin tessera
WORKDIR /opt/tessera

FROM runtime AS control-plane
COPY --from=source /src/ /opt/tessera/
RUN pip install . && rm -rf build *.egg-info
USER 10001
WORKDIR /home/tessera
ENTRYPOINT ["tessera"]
CMD ["--help"]

FROM runtime AS engine
# CUDA wheels by default (engine pods on GPUs); the CPU index makes a small image for kind/CI.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_VERSION=2.13.0

# A C++ compiler: engine pods on CPUs build their attention kernels on first
# start (engine_pod/attention/cpu_ops, for the node's own CPU), into a
# directory the non-root user can write (the /tmp emptyDir).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
ENV TORCH_EXTENSIONS_DIR=/tmp/tessera-torch-extensions

# torch first and on its own layer, before the sources: it is most of the image and changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY --from=source /src/ /opt/tessera/
RUN pip install ".[engine]" && rm -rf build *.egg-info
USER 10001
WORKDIR /home/tessera
ENTRYPOINT ["tessera"]
CMD ["--help"]
