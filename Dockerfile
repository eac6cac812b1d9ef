# The one image of every service in docker-compose.yml: Flower 1.42.0's SuperExec image, which carries
# flower-superlink, flower-supernode, flower-superexec, flwr-serverapp, flwr-clientapp and the flwr CLI,
# plus this project with its pinned dependencies, so the ServerApp and ClientApp processes that the
# executors start find torch, scikit-learn and flwr-datasets. Each service picks its entry point.
#   docker compose build        (or: docker build -t alignfl:flwr-1.42.0 .)
# Python 3.11: the project requires it, and the image's default tag carries another version.
# Where Docker Hub is out of reach, scripts/compose_check.sh builds a stand-in with the same layout
# (docker/base.Dockerfile) and passes it as --build-arg FLWR_IMAGE=...
ARG FLWR_IMAGE=flwr/superexec:1.42.0-py3.11-ubuntu24.04

# The dependency list alone (pyproject.toml's [project] dependencies), so that the heavy layer below (torch)
# is rebuilt only when that list changes, not on every code or metadata change.
FROM ${FLWR_IMAGE} AS requirements
WORKDIR /app
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
    > requirements.txt

FROM ${FLWR_IMAGE}

# torch's CPU wheels by default (the CUDA ones are gigabytes); for GPUs pass e.g.
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# An empty TORCH_INDEX installs PyPI's torch (CUDA wheels) where that index is unreachable.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Where pip must reach packages through another index (a mirror), pass PIP_INDEX_URL / PIP_EXTRA_INDEX_URL.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_DEFAULT_TIMEOUT=60

# The base image runs as user "app" (uid 49999) in /app, its home, with a virtual environment on PATH.
WORKDIR /app
COPY --from=requirements /app/requirements.txt /tmp/alignfl-requirements.txt
# Optional build secret "ca_bundle": a CA bundle for pip where HTTPS is re-signed by a local CA
# (docker build --secret id=ca_bundle,src=/etc/ssl/certs/ca-certificates.crt ...); without it, pip's own.
RUN --mount=type=secret,id=ca_bundle,required=false,mode=0444 \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && python -m pip install --no-cache-dir ${TORCH_INDEX:+--extra-index-url=$TORCH_INDEX} \
       -r /tmp/alignfl-requirements.txt

# The project itself (.dockerignore keeps tests, results, data, keys and the virtual environment out);
# its dependencies are all installed above.
COPY --chown=app:app . ./
RUN --mount=type=secret,id=ca_bundle,required=false,mode=0444 \
    if [ -s /run/secrets/ca_bundle ]; then export PIP_CERT=/run/secrets/ca_bundle; fi \
    && python -m pip install --no-cache-dir --no-deps . \
    && python -m pip check \
    && python -c "import flwr; assert flwr.__version__ == '1.42.0', f'flwr {flwr.__version__} is not the pinned 1.42.0'" \
    # mount points owned by "app": SuperLink state, run folders (results-dir's default ~/alignfl-results),
    # torchvision data (data-root's default), certificates
    && mkdir -p /app/state /app/alignfl-results /app/.cache/alignfl/data /app/certs

# No telemetry, no update checks, no dependency installation at run time (the image has them): works offline.
# SuperExecs look for new work every 0.1 s instead of every second (alignfl/fl_app/runtime/superlink.py: SUPEREXEC_POLL_S).
ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
    FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1

ENTRYPOINT ["flower-superexec"]
