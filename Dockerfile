# One image for every service; compose.yaml picks the service with `ito-training serve NAME`.
# The control plane's image takes torch's CPU wheel (the default TORCH_INDEX); the trainer's takes a
# CUDA wheel from the same Dockerfile: `--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130`
# (compose.yaml's trainer does; the wheel carries the CUDA runtime, the node only needs the driver
# and the NVIDIA container toolkit). It runs as an unprivileged user (ITO_UID, 10001 by default)
# that owns /data and nothing else: the root filesystem can be mounted read-only (compose.yaml,
# deploy/k8s/), with /tmp a tmpfs.
#
# Two targets: `service` (the control plane, the default: no compiler) and `trainer` (compose.yaml's
# and deploy/k8s' trainer image: `--target trainer`), which adds the C toolchain and the compile
# caches torch.compile needs (below).
FROM python:3.11-slim AS service
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG ITO_UID=10001
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN groupadd -g "${ITO_UID}" ito \
 && useradd -u "${ITO_UID}" -g ito -M -d /tmp -s /usr/sbin/nologin ito \
 && mkdir -p /data && chown "${ITO_UID}:${ITO_UID}" /data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contracts ./contracts
COPY domain ./domain
COPY runtime ./runtime
COPY training ./training
COPY services ./services
COPY ops ./ops
COPY ecc ./ecc
# torch first, pinned exactly, from TORCH_INDEX (PyPI's own Linux wheel is a multi-GB CUDA build).
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" torch==2.13.0 \
 && pip install --no-cache-dir -e '.[s3]'
ENV ITO_DATA_DIR=/data
USER ${ITO_UID}:${ITO_UID}
ENTRYPOINT ["ito-training"]

# The trainer: torch.compile's Inductor writes C++ (CPU) and Triton kernels (GPU) and builds them
# with the system compiler (Triton also builds its launcher stub against Python.h, which the
# python image carries); python:3.11-slim has none, so without build-essential every compiled
# step would fail or fall back to eager. The control plane never compiles: it stays without one.
# The compile caches live under /var/cache/ito, a volume (compose.yaml's ito-compile-cache,
# deploy/k8s/trainer.yaml's compile-cache: sized for them), not under HOME=/tmp: a restarted
# trainer finds its kernels instead of compiling them again, and /tmp stays small.
FROM service AS trainer
ARG ITO_UID=10001
USER root
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /var/cache/ito/inductor /var/cache/ito/triton \
 && chown -R "${ITO_UID}:${ITO_UID}" /var/cache/ito
ENV TORCHINDUCTOR_CACHE_DIR=/var/cache/ito/inductor TRITON_CACHE_DIR=/var/cache/ito/triton
USER ${ITO_UID}:${ITO_UID}

# The default target (`docker build .` with no --target) stays the control plane's image.
FROM service
