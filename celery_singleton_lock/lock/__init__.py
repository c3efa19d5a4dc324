"""The lock core: the lease, its nodes and fan-out, the record, the scripts, renewal. Nothing of Celery."""
