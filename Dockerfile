# The image behind docker-compose.yml's workers, beat instances and demo: the package, its examples and
# prometheus_client (for examples/prometheus_metrics.py). Not a base image for your own project.
#
# With a registry: `docker build .` as it is. Without one, tools/docker_images.sh builds a local base image from
# Debian's packages and passes it as BASE, with the wheels it made on the host in docker/wheels/ and
# PIP_OFFLINE=1 (pip then installs from those wheels only; a build has no package index to reach).
ARG BASE=python:3.12-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

ARG PIP_OFFLINE=
WORKDIR /app
# docker/wheels/ holds only a README in a checkout: the index is used; with PIP_OFFLINE set, nothing else is.
COPY docker/wheels/ /tmp/wheels/
COPY pyproject.toml README.md ./
COPY celery_singleton_lock/ celery_singleton_lock/
RUN pip install --find-links /tmp/wheels ${PIP_OFFLINE:+--no-index} . "prometheus-client>=0.20" \
    && rm -rf /tmp/wheels \
    && useradd --create-home --uid 10001 app
# Last, so editing an example does not reinstall the package. Run as `python -m examples.<name>` or
# `celery -A examples.example_app ...` from /app (on PYTHONPATH above).
COPY examples/ examples/

USER app
