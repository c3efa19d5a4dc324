"""What operators run: the ``celery locks`` commands, the doctor, the inventory, the page, the probes."""
