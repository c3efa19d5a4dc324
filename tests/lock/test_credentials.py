"""``singleton_lock_credential_provider``: every lock node connection (sync and async) authenticates with a redis-py
``CredentialProvider``, asked on every new connection, so a rotated password needs no restart.

A throwaway redis-server with its ``default`` user switched off and an ACL user whose password the test changes
(``ACL SETUSER``); no secret may show in a log, a repr or an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery
from redis.credentials import CredentialProvider

from celery_singleton_lock import Redlock
from celery_singleton_lock.errors import ConfigurationError
from celery_singleton_lock.lock import aio
from celery_singleton_lock.lock.aio import AsyncNodes, AsyncRedlock
from celery_singleton_lock.lock.config import settings_for
from celery_singleton_lock.testing import RedisServer

ADMIN = "admin-Kq7vZt"
FIRST = "first-Wm3pXr"
SECOND = "second-Hb8nYj"


class Rotating(CredentialProvider):
    """The credentials a secrets manager would hand out: changed in place by the test."""

    def __init__(self, username: str, password: str) -> None:
        self.username, self.password = username, password
        self.asked = 0

    def get_credentials(self) -> tuple[str, str]:
        self.asked += 1
        return self.username, self.password

    async def get_credentials_async(self) -> tuple[str, str]:
        return self.get_credentials()


#: Named by a dotted path in a test (``"test_credentials:SHARED"``).
SHARED = Rotating("locker", FIRST)


@pytest.fixture
def acl_node(fresh_node: RedisServer) -> Iterator[redis.Redis]:
    """The node with an admin user, a ``locker`` user whose password is FIRST, and ``default`` off; yields the admin
    client."""
    with contextlib.closing(fresh_node.client()) as bootstrap:
        bootstrap.acl_setuser(
            "admin", enabled=True, passwords=[f"+{ADMIN}"], keys=["*"], channels=["*"], commands=["+@all"]
        )
        bootstrap.acl_setuser(
            "locker", enabled=True, passwords=[f"+{FIRST}"], keys=["*"], channels=["*"], commands=["+@all"]
        )
        bootstrap.acl_setuser("default", enabled=False)
    admin = redis.Redis(host="127.0.0.1", port=fresh_node.port, username="admin", password=ADMIN)
    yield admin
    admin.close()


def rotate(admin: redis.Redis, provider: Rotating | None, password: str) -> None:
    """Change ``locker``'s password on the server (and in ``provider``), then drop its open connections, so the
    next command of a lock opens a new one."""
    admin.acl_setuser("locker", enabled=True, reset_passwords=True, passwords=[f"+{password}"])
    if provider is not None:
        provider.password = password
    admin.execute_command("CLIENT", "KILL", "USER", "locker")


def app_on(url: str, provider: object) -> Celery:
    app = Celery(f"cred-{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(
        singleton_lock_urls=[url],
        singleton_lock_prefix=f"cred-{uuid.uuid4().hex[:8]}:",
        singleton_lock_credential_provider=provider,
    )
    return app


def no_secret(*texts: str) -> None:
    for text in texts:
        for secret in (ADMIN, FIRST, SECOND):
            assert secret not in text


def test_a_rotated_password_is_used_by_new_connections_without_a_restart(
    acl_node: redis.Redis, fresh_node: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Locks authenticate as the provider says; after the ACL password changes and the provider hands out the new
    one, new connections use it (same settings, same process); a provider still on the old one gets refused with
    errors, logs and reprs that name no password."""
    provider = Rotating("locker", FIRST)
    settings = settings_for(app_on(fresh_node.url, provider))
    key = f"{settings.prefix}k"
    first = Redlock(settings.nodes, key, ttl=5)
    assert first.acquire(blocking=False)
    assert first.release()
    asked = provider.asked
    assert asked >= 1
    rotate(acl_node, provider, SECOND)
    second = Redlock(settings.nodes, key, ttl=5)
    assert second.acquire(blocking=False)
    assert second.release()
    assert provider.asked > asked  # a new connection asked again
    with caplog.at_level(logging.DEBUG):
        rotate(acl_node, None, FIRST + "x")  # the server moved on; the provider did not
        refused = Redlock(settings.nodes, key, ttl=5)
        assert not refused.acquire(blocking=False)
    errors = [str(e) for e in refused.node_errors]
    assert errors
    assert any("Authentication" in e or "WRONGPASS" in e or "invalid username-password" in e for e in errors), errors
    no_secret(caplog.text, *errors, repr(settings), settings.describe(), repr(settings.nodes), repr(refused))
    assert "credential_provider=<Rotating>" in repr(settings)


def test_a_lock_built_per_use_from_the_url_uses_a_provider_set_after_an_earlier_one(
    acl_node: redis.Redis, fresh_node: RedisServer
) -> None:
    """``Redlock(url, ...)`` built per use: one built before the app's provider is set cannot log in; one built from
    the same URL string after it (the URL list's parse is cached per process) authenticates with the provider."""
    before = Redlock(fresh_node.url, "per-use:k", ttl=5)
    assert not before.acquire(blocking=False)
    assert before.node_errors
    settings = settings_for(app_on(fresh_node.url, Rotating("locker", FIRST)))
    after = Redlock(fresh_node.url, f"{settings.prefix}k", ttl=5)
    assert after.acquire(blocking=False), after.node_errors
    assert after.release()


def test_async_locks_use_the_provider_too(acl_node: redis.Redis, fresh_node: RedisServer) -> None:
    """AsyncRedlock on the app's node URLs authenticates through the same provider: new connections use the rotated
    password, and a stale one is refused."""
    provider = Rotating("locker", FIRST)
    settings = settings_for(app_on(fresh_node.url, provider))

    async def take(name: str) -> bool:
        lock = AsyncRedlock(AsyncNodes([fresh_node.url]), name, ttl=5, auto_renewal=False)
        try:
            held = await lock.acquire(blocking=False)
            if held:
                await lock.release()
            return held
        finally:
            await aio.aclose()

    assert asyncio.run(take(f"{settings.prefix}a"))
    asked = provider.asked
    assert asked >= 1
    # The server's password changes; open connections stay logged in, so a new event loop (its own clients, new
    # connections) shows what new connections use.
    acl_node.acl_setuser("locker", enabled=True, reset_passwords=True, passwords=[f"+{SECOND}"])
    provider.password = SECOND
    assert asyncio.run(take(f"{settings.prefix}b"))
    assert provider.asked > asked
    acl_node.acl_setuser("locker", enabled=True, reset_passwords=True, passwords=[f"+{FIRST}"])
    assert not asyncio.run(take(f"{settings.prefix}c"))  # the provider still hands out SECOND: refused


def test_a_dotted_path_names_the_provider(acl_node: redis.Redis, fresh_node: RedisServer) -> None:
    """``"module:attribute"`` resolves to the provider instance."""
    settings = settings_for(app_on(fresh_node.url, "test_credentials:SHARED"))
    assert settings.credential_provider is SHARED
    lock = Redlock(settings.nodes, f"{settings.prefix}k", ttl=5)
    assert lock.acquire(blocking=False)
    assert lock.release()


def test_a_password_in_the_url_beside_a_provider_is_refused_in_one_line(fresh_node: RedisServer) -> None:
    """A URL with user:password and a provider: one line saying to remove them, the password not in it; a value
    that is no provider names what to give."""
    url = f"redis://locker:{FIRST}@127.0.0.1:{fresh_node.port}/0"
    with pytest.raises(ConfigurationError) as both:
        settings_for(app_on(url, Rotating("locker", FIRST)))
    assert "remove them from the URL" in str(both.value)
    assert "\n" not in str(both.value)
    no_secret(str(both.value))
    with pytest.raises(ConfigurationError, match=r"must be a redis\.credentials\.CredentialProvider instance"):
        settings_for(app_on(fresh_node.url, 42))
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        settings_for(app_on(fresh_node.url, "no_such_module:provider"))
