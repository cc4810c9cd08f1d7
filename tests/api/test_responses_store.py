"""The store behind previous_response_id keeps at most its count, its age and its characters, and shows a
response only to the API key that made it."""

from __future__ import annotations

from pagedserve.api.responses.store import MESSAGE_OVERHEAD, ResponseStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_the_oldest_go_first_past_the_count() -> None:
    store = ResponseStore(max_entries=3, ttl_s=60)
    for i in range(5):
        assert store.put(f"resp_{i}", "", turn(str(i)))
    assert len(store) == 3
    assert store.get("resp_0", "") is None and store.get("resp_1", "") is None
    assert store.get("resp_4", "") == turn("4")


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=30, clock=clock)
    store.put("resp_old", "", turn("old"))
    clock.now = 20
    store.put("resp_new", "", turn("new"))
    clock.now = 31
    assert store.get("resp_old", "") is None and len(store) == 1 and store.get("resp_new", "") == turn("new")
    clock.now = 51
    assert store.get("resp_new", "") is None and len(store) == 0 and store.num_chars == 0


def test_the_characters_held_stay_under_the_limit() -> None:
    one = len('[{"role": "user", "content": "xxxxxxxxxx"}]') + MESSAGE_OVERHEAD
    store = ResponseStore(max_entries=100, ttl_s=60, max_chars=3 * one)
    for i in range(10):
        assert store.put(f"resp_{i}", "", turn("x" * 10))
        assert store.num_chars <= 3 * one
    assert len(store) == 3 and store.get("resp_9", "") is not None
    assert not store.put("resp_big", "", turn("x" * (3 * one)))  # larger than the whole store: not kept
    assert store.get("resp_big", "") is None and len(store) == 3


def test_another_keys_response_is_unknown() -> None:
    store = ResponseStore(max_entries=10, ttl_s=60)
    store.put("resp_a", "alice", turn("secret"))
    assert store.get("resp_a", "bob") is None and store.get("resp_a", "") is None
    assert store.get("resp_a", "alice") == turn("secret")


def test_a_size_of_zero_stores_nothing() -> None:
    store = ResponseStore(max_entries=0, ttl_s=60)
    assert not store.put("resp_a", "", turn("x")) and len(store) == 0


def test_many_empty_messages_weigh_what_their_dicts_do() -> None:
    store = ResponseStore(max_entries=100, ttl_s=60, max_chars=100 * MESSAGE_OVERHEAD)
    assert not store.put("resp_a", "", [{"role": "user", "content": ""}] * 100)
    assert store.put("resp_b", "", [{"role": "user", "content": ""}] * 50)
