# codebuddy2api container image: `docker build -t codebuddy2api .` (deploy/compose.yaml uses it).
# Stage 1 builds the wheel (with the WebUI inside) and every dependency's wheel;
# stage 2 installs them offline into a slim image and runs as a non-root user.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY webui ./webui
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# The data directory exists in the image, owned by the gateway's user: Docker initialises an
# empty named volume mounted there (deploy/compose.yaml) from it, so the volume is writable
# by uid 10001 rather than root-owned.
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/codebuddy2api --create-home codebuddy2api \
    && install -d -m 0700 -o 10001 -g 10001 /var/lib/codebuddy2api/data
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels /wheels/codebuddy2api-*.whl && rm -rf /wheels
USER 10001:10001
WORKDIR /var/lib/codebuddy2api
# Inside a container the gateway must listen on every interface; it then refuses to start
# without client keys (CODEBUDDY2API_API_KEY) and a real upstream (CODEBUDDY2API_UPSTREAM_URL
# or CODEBUDDY2API_CONFIG): see deploy/.env.example.
ENV CODEBUDDY2API_HOST=0.0.0.0 \
    CODEBUDDY2API_PORT=8080 \
    CODEBUDDY2API_DATA_DIR=/var/lib/codebuddy2api/data \
    PYTHONUNBUFFERED=1
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('CODEBUDDY2API_PORT', '8080'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/readyz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["codebuddy2api"]
CMD ["serve"]
