# Images for deploy/ (Kubernetes manifests):
#   docker build --target kvstack -t kvstack:latest .            # router, endpoint picker, sidecar, cache server
#   docker build --target kvstack-vllm -t kvstack-vllm:latest .  # vLLM with KVStackConnector importable
# VLLM_IMAGE is the engine base: vllm/vllm-openai for GPUs; a CPU build of vLLM 0.32 on CPU-only clusters.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# The request path is compiled with mypyc (setup.py): built where a C compiler is, installed into the slim image.
FROM python:3.11 AS kvstack-wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM python:3.11-slim AS kvstack
COPY --from=kvstack-wheel /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 65534
ENTRYPOINT ["kvstack"]

FROM ${VLLM_IMAGE} AS kvstack-vllm
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# The connector needs only what vLLM brings (pyzmq, msgspec, blake3) and xxhash: not kvstack's server deps,
# nor the compiled request path (KVSTACK_COMPILE=0).
RUN KVSTACK_COMPILE=0 pip install --no-cache-dir --no-deps . 'xxhash>=3.4' && python -c "import kvstack.connector" && rm -rf /src
