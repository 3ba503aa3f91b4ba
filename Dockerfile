# autobatch service: one per GPU node (see deploy/daemonset.yaml).
#   docker build -t autobatch .
#   docker run --gpus all -p 8000:8000 -v autobatch-store:/var/lib/autobatch autobatch
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    AUTOBATCH_STORE_PATH=/var/lib/autobatch/profiles.sqlite3

WORKDIR /opt/autobatch
COPY pyproject.toml README.md ./
COPY autobatch ./autobatch
COPY service ./service

# torch comes from the base image. The other dependencies are pinned to the versions CI tests
# (pyproject's [service] extra); then the package itself, without resolving again.
RUN pip install --no-cache-dir \
        fastapi==0.165.0 \
        uvicorn==0.54.0 \
        uvloop==0.23.0 \
        httptools==0.9.0 \
        pydantic==2.14.4 \
        pydantic-settings==2.16.3 \
        prometheus-client==0.26.0 \
        httpx==0.28.1 \
        nvidia-ml-py==13.615.71 \
        tqdm==4.70.1 \
    && pip install --no-cache-dir --no-deps /opt/autobatch \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/autobatch autobatch \
    && mkdir -p /var/lib/autobatch \
    && chown autobatch:autobatch /var/lib/autobatch

USER 10001:10001
VOLUME ["/var/lib/autobatch"]
EXPOSE 8000

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4).status != 200)"]

CMD ["autobatch", "serve", "--host", "0.0.0.0", "--port", "8000"]
