# One image for both services: the dashboard server and the multi-rank demo job.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends graphviz g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
# CPU torch for the demo; a GPU deployment installs its own CUDA torch instead.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -e ".[demo]"
ENV GRAPHDECK_STORE=/data/graphdeck.db
