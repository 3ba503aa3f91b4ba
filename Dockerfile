# autobatch service: the node DaemonSet or a container in a training pod (docs/deploy.md).
#   docker build -t autobatch .
#   docker run --gpus all -p 8000:8000 -v autobatch-store:/var/lib/autobatch autobatch
#
# torch is the release CI tests (.ci/run installs torch==2.13.0; tests/service/test_container.py
# holds the two pins equal), from PyPI, whose Linux x86_64 wheel is the CUDA build and brings the
# CUDA runtime as nvidia-* wheels: the node needs only the driver, which the NVIDIA container
# runtime mounts. A plain Python base rather than a pytorch/pytorch tag, so the image's torch is
# set here, by the same pin CI installs, and not by whichever release a base tag carries.
# TORCH_INDEX_URL picks another build of the same release (https://download.pytorch.org/whl/cpu,
# .../whl/cu1xx for another CUDA).
FROM python:3.11-slim-bookworm

ARG TORCH_INDEX_URL=https://pypi.org/simple

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    AUTOBATCH_STORE=/var/lib/autobatch/profiles.sqlite3

# torch, then the other dependencies pinned to versions CI runs (pyproject's core, [service] and
# [models]: probe jobs of Hugging Face models need transformers), in one layer that changes only
# when a pin does.
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" torch==2.13.0 \
    && pip install --no-cache-dir \
        numpy==2.4.6 \
        fastapi==0.165.0 \
        uvicorn==0.54.0 \
        uvloop==0.23.0 \
        httptools==0.9.0 \
        pydantic==2.14.4 \
        pydantic-settings==2.16.3 \
        prometheus-client==0.26.0 \
        httpx==0.28.1 \
        sqlalchemy==2.1.9 \
        psycopg==3.3.9 \
        psycopg-binary==3.3.9 \
        nvidia-ml-py==13.615.71 \
        tqdm==4.70.1 \
        transformers==5.24.0

WORKDIR /opt/autobatch
COPY pyproject.toml README.md ./
COPY autobatch ./autobatch
COPY service ./service
# The example registry's factories (examples/models.toml); the server imports registry
# factories from its working directory, this one. Your own models: docs/deploy.md.
COPY examples/__init__.py examples/models.py examples/models.toml ./examples/

# The package itself, without resolving again; then the user the server runs as, and its store
# directory (a volume; on Kubernetes, storage that uid 10001 can write: see deploy/).
RUN pip install --no-cache-dir --no-deps /opt/autobatch \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/autobatch autobatch \
    && mkdir -p /var/lib/autobatch \
    && chown autobatch:autobatch /var/lib/autobatch

USER 10001:10001
VOLUME ["/var/lib/autobatch"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

CMD ["autobatch", "serve", "--host", "0.0.0.0", "--port", "8000"]
