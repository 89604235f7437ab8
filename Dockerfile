# The swarmfd runtime image: Python 3.11 in a venv at /opt/venv with swarmfd and its
# dependencies, the examples under /opt/swarmfd/examples, and the Swarm entrypoint.
#
# Online (a normal machine):   docker build -t swarmfd .
# Offline (no registry, no package index during the build; scripts/setup-docker.sh):
#   put manylinux cp311 wheels of the dependencies (and setuptools) in wheelhouse/, then
#   docker build --build-arg BASE_IMAGE=<local image with python3 + venv> -t swarmfd .
# With wheels in wheelhouse/ pip installs with --no-index from them; with only the
# .keep file there it installs from the package index.
#
# Three stages keep the image small and rebuilds fast: the wheelhouse never reaches the
# final image, and editing swarmfd's source only rebuilds its (small) wheel layer.
ARG BASE_IMAGE=python:3.11-slim

# --- deps: the venv with the runtime dependencies (from pyproject.toml alone) ---------
FROM ${BASE_IMAGE} AS deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_CONFIG_FILE=/tmp/pip.conf
COPY wheelhouse/ /tmp/wheelhouse/
COPY pyproject.toml /tmp/deps/pyproject.toml
# A venv side-steps PEP 668 (Debian's python is "externally managed"). The runtime needs
# neither the venv's setuptools nor numpy's test suite (about 15 MB together).
RUN set -eu; \
    if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
        echo "installing from the wheelhouse (offline)"; \
        printf '[global]\nno-index = true\nfind-links = /tmp/wheelhouse\n' > /tmp/pip.conf; \
    else \
        echo "no wheels in wheelhouse/: installing from the package index"; \
        : > /tmp/pip.conf; \
    fi; \
    python3 -m venv /opt/venv; \
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("/tmp/deps/pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/deps/requirements.txt; \
    /opt/venv/bin/pip install --quiet -r /tmp/deps/requirements.txt; \
    /opt/venv/bin/pip uninstall --quiet --yes setuptools; \
    find /opt/venv/lib -type d -path '*/site-packages/numpy/*' -name tests -prune -exec rm -rf {} +

# --- wheel: swarmfd's own wheel, and the examples ---------------------------------------
FROM deps AS wheel
COPY . /tmp/src/
RUN set -eu; \
    /opt/venv/bin/pip wheel --quiet --no-deps --wheel-dir /tmp/dist /tmp/src; \
    mkdir -p /tmp/examples; \
    if [ -d /tmp/src/examples ]; then cp -r /tmp/src/examples/. /tmp/examples/; fi

# --- the runtime image -----------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LANG=C.UTF-8 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY --from=deps /opt/venv /opt/venv
COPY --from=wheel /tmp/examples/ /opt/swarmfd/examples/
COPY --from=wheel /tmp/dist/ /tmp/dist/
# The ranks run as swarmfd (uid 10001), not root: the entrypoint, started as root, drops
# to it before it runs the command (SWARMFD_USER=root keeps root). It owns the working
# directory and the checkpoint mount point (a new --checkpoint-volume takes its owner).
RUN set -eu; \
    /opt/venv/bin/pip install --quiet --no-deps --no-index /tmp/dist/*.whl; \
    rm -rf /tmp/dist /root/.cache; \
    /opt/venv/bin/python -c 'import swarmfd.entrypoint'; \
    echo 'swarmfd:x:10001:10001:swarmfd ranks:/workspace:/usr/sbin/nologin' >> /etc/passwd; \
    echo 'swarmfd:x:10001:' >> /etc/group; \
    mkdir -p /workspace /checkpoints; \
    chown 10001:10001 /workspace /checkpoints

WORKDIR /workspace
# The entrypoint turns the Swarm task slot into RANK, waits for MASTER_ADDR to resolve,
# then execs the command (see swarmfd/entrypoint.py for the environment contract).
ENTRYPOINT ["/opt/venv/bin/python", "-m", "swarmfd.entrypoint"]
CMD ["python", "-c", "import swarmfd; print('swarmfd', swarmfd.__version__)"]
