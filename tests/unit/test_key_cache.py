"""The daemon's key verifier remembers valid keys (no SQLite query per request) and forgets
them when a key is created or revoked, or after KEY_CACHE_SECONDS."""

from __future__ import annotations

from capyctl.daemon import KEY_CACHE_SECONDS, StoreKeys
from capyctl.store import Store


class CountingStore(Store):
    def __init__(self, path) -> None:
        super().__init__(path)
        self.lookups = 0

    def verify_key(self, secret: str):
        self.lookups += 1
        return super().verify_key(secret)


def test_a_valid_key_is_checked_against_the_store_once(tmp_path) -> None:
    store = CountingStore(tmp_path / "state.db")
    _, secret = store.create_key("app", ["m"])
    keys = StoreKeys(store)
    grants = [keys.verify(secret) for _ in range(100)]
    assert store.lookups == 1
    assert all(grant is not None and grant.name == "app" and grant.models == frozenset({"m"}) for grant in grants)


def test_a_revoked_key_is_refused_on_the_next_request(tmp_path) -> None:
    store = CountingStore(tmp_path / "state.db")
    _, secret = store.create_key("app")
    keys = StoreKeys(store)
    assert keys.verify(secret) is not None
    store.revoke_key("app")
    assert keys.verify(secret) is None
    assert keys.verify(secret) is None and store.lookups == 3  # refusals are never remembered


def test_a_change_by_another_process_is_seen_after_the_cache_time(tmp_path) -> None:
    store = CountingStore(tmp_path / "state.db")
    _, secret = store.create_key("app")
    now = [1000.0]
    keys = StoreKeys(store, clock=lambda: now[0])
    assert keys.verify(secret) is not None
    Store(tmp_path / "state.db").revoke_key("app")  # another Store: this one's generation stays
    now[0] += KEY_CACHE_SECONDS / 2
    assert keys.verify(secret) is not None  # still remembered ...
    now[0] += KEY_CACHE_SECONDS
    assert keys.verify(secret) is None  # ... until the cache time has passed


def test_wrong_and_odd_tokens_are_refused(tmp_path) -> None:
    # "capy-\udcff-x" is what aiohttp makes of the header bytes "capy-\xff-x": it used to reach
    # SQLite and fail there with UnicodeEncodeError, a 500 instead of a 401.
    store = Store(tmp_path / "state.db")
    _, secret = store.create_key("app")
    keys = StoreKeys(store)
    for token in ("", "capy-", secret[:-1], secret + "x", "Bearer " + secret, "capy-\udcff-x"):
        assert keys.verify(token) is None


async def test_a_key_header_that_is_not_utf8_is_401_not_500(tmp_path) -> None:
    import asyncio

    from capyctl.proxy import build_app, serve
    from tests.unit.test_proxy import FakeRouter
    store = Store(tmp_path / "state.db")
    runner = await serve(build_app(FakeRouter({}), StoreKeys(store)), host_port="127.0.0.1:0")
    host, port = runner.addresses[0][:2]
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer capy-\xff-x\r\n"
                     b"Connection: close\r\n\r\n")
        answer = await reader.read()
        writer.close()
    finally:
        await runner.cleanup()
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
