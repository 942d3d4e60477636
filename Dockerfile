# a2a-grpc-server: slim, non-root, with a gRPC health probe.
#
#   docker build -t a2a-grpc-server .
#   docker run -p 50051:50051 -p 8080:8080 a2a-grpc-server            # the echo agent
#   docker run ... -v $PWD/my_agent.py:/app/my_agent.py a2a-grpc-server --agent my_agent:MyExecutor
#   (or FROM a2a-grpc-server, COPY your agent into /app, and install its dependencies)
#
# Every setting is also an environment variable (A2A_GRPC_SERVER_<NAME>; README, Configuration).

FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[cluster,tracing,admin]"

FROM python:3.12-slim
RUN useradd --uid 10001 --create-home --home-dir /app a2a
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
WORKDIR /app
USER 10001:10001
# Only the bind address is set here (an environment variable beats a --config file, so
# nothing else is). The health probe checks port 50051, or A2A_GRPC_SERVER_PORT: set the
# port that way (not in the file) if you change it.
ENV A2A_GRPC_SERVER_HOST=0.0.0.0 \
    GRPC_VERBOSITY=ERROR \
    PYTHONUNBUFFERED=1
EXPOSE 50051 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "-m", "a2a_grpc_server.healthcheck"]
# SIGTERM drains: running tasks get shutdown_grace, every stream its final frame.
STOPSIGNAL SIGTERM
ENTRYPOINT ["a2a-grpc-server", "serve"]
