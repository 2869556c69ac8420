# fedsaddle's images: `client` (no plotting stack) and `coordinator` (the default, last stage).
#
#   docker build -t fedsaddle .                                   # the coordinator image
#   docker build --target client -t fedsaddle-client .            # the client image
#   docker run --rm fedsaddle coordinator --config /config/run.yaml --listen 0.0.0.0:50051
#   docker run --rm fedsaddle-client client --coordinator HOST:50051 --clients 0-4
#
# Without a registry (air-gapped sites, podman on a bare machine), two build
# arguments select a local base image and a directory of wheels to install from,
# offline; scripts/compose-test.sh makes both:
#
#   podman build --build-arg BASE=localhost/fedsaddle-base:bookworm \
#                --build-arg WHEELS=build/wheels -t fedsaddle .
ARG BASE=python:3.11.13-slim-bookworm

FROM ${BASE} AS client
# A directory of the build context holding wheels of every dependency: installed offline.
# The default holds none, and dependencies come from the package index.
ARG WHEELS=docker/no-wheels
ENV VIRTUAL_ENV=/opt/fedsaddle PATH=/opt/fedsaddle/bin:$PATH PYTHONUNBUFFERED=1
RUN python3 -m venv /opt/fedsaddle \
    && useradd --create-home --uid 1000 fedsaddle \
    && mkdir /runs && chown fedsaddle /runs
COPY ${WHEELS}/ /wheels/
COPY pyproject.toml /src/
# Dependencies first, in their own layer: a change to the code does not reinstall them.
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" > /src/requirements.txt \
    && if ls /wheels/*.whl >/dev/null 2>&1; then OFFLINE="--no-index --find-links /wheels"; fi \
    && pip install --no-cache-dir $OFFLINE -r /src/requirements.txt
COPY README.md /src/
COPY fedsaddle /src/fedsaddle
COPY common /src/common
COPY client /src/client
COPY server /src/server
COPY proto /src/proto
COPY experiments /src/experiments
# The example configs only (the built-in run is examples/paper-s10.yaml): installed as fedsaddle.examples.
COPY examples/__init__.py examples/*.yaml /src/examples/
COPY docker/healthcheck.py /opt/fedsaddle/healthcheck.py
# The generated gRPC modules are committed, so installing needs no code generation.
RUN if ls /wheels/*.whl >/dev/null 2>&1; then OFFLINE="--no-index --find-links /wheels"; fi \
    && pip install --no-cache-dir --no-deps $OFFLINE /src \
    && python3 -m compileall -q /opt/fedsaddle/lib \
    && rm -rf /wheels /src
USER fedsaddle
WORKDIR /home/fedsaddle
ENTRYPOINT ["fedsaddle"]
CMD ["--help"]

FROM client AS coordinator
ARG WHEELS=docker/no-wheels
USER root
COPY ${WHEELS}/ /wheels/
COPY pyproject.toml /tmp/
RUN python3 -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/pyproject.toml', 'rb'))['project']['optional-dependencies']['plot']))" > /tmp/plot.txt \
    && if ls /wheels/*.whl >/dev/null 2>&1; then OFFLINE="--no-index --find-links /wheels"; fi \
    && pip install --no-cache-dir $OFFLINE -r /tmp/plot.txt \
    && python3 -m compileall -q /opt/fedsaddle/lib \
    && rm -rf /wheels /tmp/pyproject.toml /tmp/plot.txt
USER fedsaddle
# Run outputs go here; mount a volume (or a folder) to keep them.
VOLUME ["/runs"]
EXPOSE 50051
# The standard gRPC health service, asked by a 20-line script (not the whole CLI).
HEALTHCHECK --interval=5s --timeout=5s --start-period=5s --retries=3 \
    CMD ["python3", "/opt/fedsaddle/healthcheck.py", "127.0.0.1:50051"]
