# The swarmgrad node image: CPU torch, the pinned dependency set, the demo corpus baked in.
#   docker build -t swarmgrad-node .        docker run --rm swarmgrad-node node --help
# A GPU image would start from a CUDA base and install the CUDA torch instead (same range).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 SWARMGRAD_HOME=/data

# torch first, CPU build: an open range with no torch installed would pull a multi-GB CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY requirements requirements
COPY node node
COPY protocol protocol
COPY compression compression
COPY simulations simulations
RUN pip install -c requirements/constraints.txt . \
    && swarmgrad prepare-data --cache-dir /opt/swarmgrad/cache \
    && chmod -R a+rX /opt/swarmgrad

# Keys and checkpoints live in /data (a volume per node); /shared carries a bootstrap's address.
RUN useradd --create-home --uid 1000 swarmgrad \
    && mkdir -p /data /shared && chown swarmgrad:swarmgrad /data /shared
USER swarmgrad
VOLUME ["/data"]

ENTRYPOINT ["swarmgrad"]
CMD ["--help"]
