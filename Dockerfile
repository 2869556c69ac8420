# One image for both roles: the entrypoint is the `fedsaddle` command.
#   docker build -t fedsaddle .
#   docker run --rm fedsaddle coordinator --config /config/run.yaml --listen 0.0.0.0:50051
#   docker run --rm fedsaddle client --coordinator HOST:50051 --clients 0-4
FROM python:3.11-slim

WORKDIR /src
COPY pyproject.toml README.md ./
COPY fedsaddle ./fedsaddle
COPY common ./common
COPY client ./client
COPY server ./server
COPY proto ./proto
# The generated gRPC modules are committed, so installing needs no code generation.
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 1000 fedsaddle \
    && mkdir /runs && chown fedsaddle /runs

USER fedsaddle
WORKDIR /home/fedsaddle
# Run outputs go here; mount a volume to keep them.
VOLUME ["/runs"]
EXPOSE 50051
ENTRYPOINT ["fedsaddle"]
CMD ["--help"]
