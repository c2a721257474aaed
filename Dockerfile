# Serving image of one variant (CUDA). Build: docker build --build-arg VARIANT=qwen35-4b-bf16 -t variant-lab .
# Weights are not baked in: mount weights/ at /app/weights (or let vLLM fetch a hub MODEL).
FROM python:3.11-slim
ARG VARIANT=smollm2-bf16
ENV VARIANT=${VARIANT} VLLM_TARGET=cuda HOST=0.0.0.0 PORT=8000
RUN apt-get update && apt-get install -y --no-install-recommends make && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY requirements/ requirements/
COPY Makefile pyproject.toml ./
RUN make install VLLM_TARGET=cuda
COPY scripts/ scripts/
COPY experiments/ experiments/
EXPOSE 8000
CMD ["sh", "-c", "make serve VARIANT=$VARIANT"]
