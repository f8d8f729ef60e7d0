# syntax=docker/dockerfile:1
# kvsched image: kvsched-daemon, the kvsched CLI, kvsched-gateway and kvsched-sim-engine in a venv
# under /opt/kvsched, run as the unprivileged user kvsched (uid/gid 10001). See docs/DEPLOY.md.
#   docker build -t kvsched:latest .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a venv with kvsched and its dependencies (wheels only, no compiler needed)
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/kvsched
COPY pyproject.toml README.md ./
COPY kvsched ./kvsched
RUN /opt/kvsched/bin/pip install ".[gateway]"

# ---- runtime: the venv, the configs, a non-root user; nothing else
FROM ${PYTHON_IMAGE}
ARG UID=10001
RUN groupadd --system --gid "${UID}" kvsched \
 && useradd --system --uid "${UID}" --gid kvsched --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin kvsched \
 && install -d -o kvsched -g kvsched -m 0750 /run/kvsched /var/cache/kvsched /var/cache/kvsched/numba \
 && install -d -m 0755 /etc/kvsched
COPY --from=build /opt/kvsched /opt/kvsched
COPY deploy/config/kvsched.toml deploy/config/gateway.toml /etc/kvsched/
ENV PATH=/opt/kvsched/bin:$PATH \
    NUMBA_CACHE_DIR=/var/cache/kvsched/numba \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER ${UID}:${UID}
# Validate the shipped config and compile the numba kernels into the image's cache, so a start
# only loads them (a fresh compile costs ~30 s of CPU before READY; loading them ~1.5 s).
RUN kvsched-daemon --check-config /etc/kvsched/kvsched.toml \
 && python -c "from kvsched.shm.kernels import warm_kernels; warm_kernels()"
# 9464: /metrics /healthz /readyz of the daemon; 8000: the gateway; 8100/5557: simulated engines
EXPOSE 9464 8000 8100 5557
STOPSIGNAL SIGTERM
CMD ["kvsched-daemon", "--config", "/etc/kvsched/kvsched.toml"]
