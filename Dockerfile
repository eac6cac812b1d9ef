# The one image of every service in docker-compose.yml: Flower 1.41.0's SuperExec image, which carries
# flower-superlink, flower-supernode, flower-superexec, flwr-serverapp, flwr-clientapp and the flwr CLI,
# plus this project with its pinned dependencies, so the ServerApp and ClientApp processes that the
# executors start find torch, scikit-learn and flwr-datasets. Each service picks its entry point.
#   docker compose build        (or: docker build -t alignfl .)
# Python 3.11: the project requires it, and the image's default tag carries another version.
ARG FLWR_IMAGE=flwr/superexec:1.41.0-py3.11-ubuntu24.04
FROM ${FLWR_IMAGE}

# torch's CPU wheels by default (the CUDA ones are gigabytes); for GPUs pass e.g.
#   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# The base image runs as user "app" (uid 49999) in /app, its home, with a virtual environment on PATH.
WORKDIR /app
COPY --chown=app:app pyproject.toml README.md ./
COPY --chown=app:app fl_app ./fl_app
COPY --chown=app:app strategies ./strategies
COPY --chown=app:app models ./models
COPY --chown=app:app core ./core
RUN python -m pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" . \
    && python -c "import flwr; assert flwr.__version__ == '1.41.0', f'flwr {flwr.__version__} is not the pinned 1.41.0'" \
    # mount points owned by "app": SuperLink state, run folders (results-dir's default ~/alignfl-results),
    # torchvision data (data-root's default), certificates
    && mkdir -p /app/state /app/alignfl-results /app/.cache/alignfl/data /app/certs

# No telemetry, no update checks, no dependency installation at run time (the image has them): works offline.
ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

ENTRYPOINT ["flower-superexec"]
