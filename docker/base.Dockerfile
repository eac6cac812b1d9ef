# A stand-in for Flower's flwr/superexec:1.42.0-py3.11-* image where no container registry is reachable:
# the same layout (Python 3.11, flwr==1.42.0 in the virtual environment /python/venv on PATH, user "app" with
# uid 49999 whose home is the working directory /app, entry point flower-superexec), on Debian bookworm.
# scripts/compose_check.sh makes ROOTFS_IMAGE with `debootstrap --variant=minbase bookworm` and `docker import`
# (python3, python3-venv, ca-certificates and libsqlite3-0 included), then builds this file:
#   docker buildx build --network host --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt \
#     -f docker/base.Dockerfile -t alignfl-base:flwr-1.42.0-py3.11-bookworm docker
# and passes the result to ../Dockerfile as --build-arg FLWR_IMAGE=alignfl-base:flwr-1.42.0-py3.11-bookworm.
ARG ROOTFS_IMAGE=alignfl-rootfs:bookworm-minbase
FROM ${ROOTFS_IMAGE}

ARG FLWR_VERSION=1.42.0
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_DEFAULT_TIMEOUT=60
ENV DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8

# Optional build secret "ca_bundle": a CA bundle for pip where HTTPS is re-signed by a local CA.
RUN --mount=type=secret,id=ca_bundle,required=false,mode=0444 \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && python3.11 -m venv /python/venv \
    && /python/venv/bin/python -m pip install --no-cache-dir -U pip setuptools \
    && /python/venv/bin/python -m pip install --no-cache-dir "flwr==${FLWR_VERSION}" \
    && useradd --uid 49999 --user-group --no-create-home --home-dir /app --shell /bin/bash app \
    && mkdir -p /app \
    && chown -R app:app /app /python/venv

ENV PATH=/python/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONIOENCODING=UTF-8

WORKDIR /app
USER app
ENV HOME=/app
ENTRYPOINT ["flower-superexec"]
