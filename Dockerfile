# One image for the dashboard server and the multi-rank demo job (docker-compose.yml).
FROM python:3.11-slim
# g++: Inductor's CPU code generation in the demo (the graph view's layout is igraph's: no graphviz).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md /app/
COPY graphdeck /app/graphdeck
COPY store /app/store
COPY capture /app/capture
COPY analysis /app/analysis
COPY server /app/server
COPY frontend /app/frontend
COPY replay /app/replay
# CPU torch for the demo; a GPU deployment installs its own CUDA torch instead. postgres: psycopg.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir ".[demo,postgres]"
RUN useradd --create-home --uid 1000 graphdeck && mkdir -p /data && chown graphdeck /data
USER graphdeck
ENV GRAPHDECK_STORE=/data/graphdeck.db GRAPHDECK_DATA_DIR=/data/uploads
EXPOSE 8765
CMD ["graphdeck", "serve", "--host", "0.0.0.0", "--port", "8765"]
