# The image behind docker-compose.yml's workers, beat instances and demo: the package, its examples and
# prometheus_client (for examples/prometheus_metrics.py). Not a base image for your own project.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app
COPY pyproject.toml README.md ./
COPY celery_singleton_lock/ celery_singleton_lock/
RUN pip install . "prometheus-client>=0.20" \
    && useradd --create-home --uid 10001 app
# Last, so editing an example does not reinstall the package. Run as `python -m examples.<name>` or
# `celery -A examples.example_app ...` from /app (on PYTHONPATH above).
COPY examples/ examples/

USER app
