"""Django settings for tests/task/test_beat_django.py: django-celery-beat's models in a throwaway PostgreSQL database
(CSL_PG_DB, on 127.0.0.1:5432 as user postgres, trust auth)."""

import os

SECRET_KEY = "test-only-not-secret"
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["django_celery_beat"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["CSL_PG_DB"],
        "USER": os.environ.get("CSL_PG_USER", "postgres"),
        "HOST": os.environ.get("CSL_PG_HOST", "127.0.0.1"),
        "PORT": os.environ.get("CSL_PG_PORT", "5432"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
