"""The routers (gateway/upstream/routing.py), fed directly: candidates, sessions, prefix
chains, a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.upstream.routing import (
    CacheAwareRouter,
    EngineLoad,
    Pace,
    PrefixIndex,
    RoundRobinRouter,
    StickySessions,
    prefix_chain,
)


@dataclass
class Fake:
    id: str
    in_flight: int = 0


def replicas(*loads: int) -> list[Fake]:
    return [Fake(f"r{i}", load) for i, load in enumerate(loads)]


def chat(*texts: str, model: str = "m", tools: list | None = None) -> dict:
    messages = [{"role": "system", "content": "You are terse."}]
    messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
    return {"model": model, "messages": messages, **({"tools": tools} if tools else {})}


def router(now: list[float] | None = None, **kw: float) -> CacheAwareRouter:
    clock = now or [0.0]
    return CacheAwareRouter(lambda: clock[0], **kw)  # type: ignore[arg-type]


# -- the prefix chain -------------------------------------------------------------------


def test_prefix_chain_shares_exactly_the_shared_messages() -> None:
    first = prefix_chain(chat("hi"))
    second = prefix_chain(chat("hi", "hello", "more"))
    assert len(first) == 2 and len(second) == 4
    assert second[:2] == first
    other = prefix_chain(chat("bye", "hello", "more"))
    assert other[0] == first[0] and other[1] != first[1] and other[2] != second[2]


def test_prefix_chain_depends_on_model_and_tools() -> None:
    tool = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    base = prefix_chain(chat("hi"))
    assert prefix_chain(chat("hi", model="other"))[0] != base[0]
    assert prefix_chain(chat("hi", tools=tool))[0] != base[0]
    assert prefix_chain({"model": "m"}) == () and prefix_chain({"messages": "x"}) == ()


def test_prefix_chain_of_long_messages_sees_their_length_head_and_tail() -> None:
    long = "x" * 10_000
    base = prefix_chain(chat(long))
    assert prefix_chain(chat(long + "y"))[1] != base[1]  # another length
    assert prefix_chain(chat("y" + long[1:]))[1] != base[1]  # another head
    assert prefix_chain(chat(long[:-1] + "y"))[1] != base[1]  # another tail
    parts = chat("hi")
    parts["messages"][1]["content"] = [{"type": "text", "text": "hi"}]
    assert prefix_chain(parts)[1] != base[1] and prefix_chain(parts)[0] == base[0]  # parts, not a string


# -- the prefix index -------------------------------------------------------------------


def test_prefix_index_finds_the_longest_prefix_sent_to_each_replica() -> None:
    index = PrefixIndex()
    turn1, turn2 = prefix_chain(chat("a")), prefix_chain(chat("a", "b", "c"))
    index.record("r0", turn1)
    assert index.match("r0", turn2) == 2 and index.match("r1", turn2) == 0
    index.record("r1", turn2)
    assert index.match("r1", turn2) == 4 and index.match("r1", prefix_chain(chat("a", "b", "z"))) == 3


def test_prefix_index_is_bounded_and_evicts_long_prefixes_first() -> None:
    index = PrefixIndex(max_per_replica=5)
    old = prefix_chain(chat("a", "b", "c"))  # 4 hashes
    index.record("r0", old)
    new = prefix_chain(chat("z", "y", model="other"))  # 3 hashes, 7 in all: the 2 longest of the old go
    index.record("r0", new)
    assert index.size("r0") == 5
    assert index.match("r0", new) == 3
    assert index.match("r0", old) == 2  # still prefix-closed: the shortest were kept
    index.forget("r0")
    assert index.match("r0", new) == 0


# -- cache-aware: rules 1 to 5 -----------------------------------------------------------


def test_a_session_stays_on_its_replica() -> None:
    r = router()
    pool = replicas(0, 0, 0)
    first = r.route(pool, session="s1")
    assert first.reason == "least_loaded"
    pool[0].in_flight = pool[1].in_flight = pool[2].in_flight = 3
    first.replica.in_flight = 5  # busier, but within the gate (3 * 1.5 + 8)
    again = r.route(pool, session="s1")
    assert again.replica is first.replica and again.reason == "session"


def test_a_call_without_a_session_goes_where_its_prefix_was_sent() -> None:
    r = router()
    pool = replicas(0, 0, 0)
    turn1 = r.route(pool, prefix=prefix_chain(chat("task one")))
    r.route(pool, prefix=prefix_chain(chat("task two")))  # the shared system prompt reaches another replica
    pool[0].in_flight = pool[1].in_flight = pool[2].in_flight = 1
    turn1.replica.in_flight = 4
    turn2 = r.route(pool, prefix=prefix_chain(chat("task one", "done", "next")))
    assert turn2.replica is turn1.replica and turn2.reason == "prefix"


def test_a_prefix_every_replica_holds_decides_nothing() -> None:
    r = router(imbalance_rel=1.0, imbalance_abs=0)
    pool = replicas(0, 0)
    first = r.route(pool, prefix=prefix_chain(chat("a"))).replica
    first.in_flight = 1
    second = r.route(pool, prefix=prefix_chain(chat("b")))  # the system prompt's replica is busier: gated
    assert second.replica is not first and second.reason == "rebalanced"
    first.in_flight = 0
    assert r.index.match("r0", prefix_chain(chat("c"))) == r.index.match("r1", prefix_chain(chat("c"))) == 1
    pool[0].in_flight = 2
    fresh = r.route(pool, prefix=prefix_chain(chat("c")))
    assert fresh.replica is pool[1] and fresh.reason == "least_loaded"


def test_least_loaded_wins_and_ties_take_turns() -> None:
    r = router()
    pool = replicas(3, 1, 2)
    assert r.route(pool).replica is pool[1]
    idle = replicas(0, 0, 0)
    picked = [r.route(idle).replica.id for _ in range(6)]
    assert sorted(picked) == ["r0", "r0", "r1", "r1", "r2", "r2"]


def test_the_imbalance_gate_moves_the_session_to_the_least_loaded() -> None:
    r = router(imbalance_rel=1.5, imbalance_abs=2)
    pool = replicas(0, 0)
    home = r.route(pool, session="s1").replica
    other = pool[1] if home is pool[0] else pool[0]
    home.in_flight, other.in_flight = 5, 2  # limit 2 * 1.5 + 2 = 5: not over it
    assert r.route(pool, session="s1").replica is home
    home.in_flight = 6
    moved = r.route(pool, session="s1")
    assert moved.replica is other and moved.reason == "rebalanced"
    home.in_flight = 0  # the session was re-mapped: it stays where it went
    assert r.route(pool, session="s1").replica is other


def test_the_gate_applies_to_a_prefix_choice_too() -> None:
    r = router(imbalance_rel=1.0, imbalance_abs=0)
    pool = replicas(0, 0)
    chain = prefix_chain(chat("x"))
    home = r.route(pool, prefix=chain).replica
    home.in_flight = 1
    moved = r.route(pool, prefix=prefix_chain(chat("x", "y", "z")))
    assert moved.replica is not home and moved.reason == "rebalanced"


def test_failover_moves_the_session() -> None:
    r = router()
    pool = replicas(0, 0, 0)
    home = r.route(pool, session="s1").replica
    rest = [c for c in pool if c is not home]
    retry = r.route(rest, session="s1", failover=True)  # the attempt on home failed: it is excluded
    assert retry.replica in rest and retry.reason == "failover"
    again = r.route(pool, session="s1")  # home is usable again: the session stays where it moved
    assert again.replica is retry.replica and again.reason == "session"


def test_a_session_whose_replica_is_unusable_fails_over() -> None:
    r = router()
    pool = replicas(0, 0)
    home = r.route(pool, session="s1").replica
    other = [c for c in pool if c is not home]
    moved = r.route(other, session="s1")  # home penalised, cooling or at its cap: not a candidate
    assert moved.replica is other[0] and moved.reason == "failover"


def test_sessions_expire_after_their_ttl() -> None:
    now = [0.0]
    r = CacheAwareRouter(lambda: now[0], sessions=StickySessions(lambda: now[0], ttl=10))
    pool = replicas(0, 0)
    home = r.route(pool, session="s1").replica
    now[0] = 11.0
    home.in_flight = 1
    fresh = r.route(pool, session="s1")
    assert fresh.replica is not home and fresh.reason == "least_loaded"


# -- pace: a slow replica's calls weigh more ----------------------------------------------


def test_pace_is_a_weighted_mean_relative_to_the_fastest() -> None:
    pace = Pace(weight=0.5, cap=4.0, min_samples=1)
    assert pace.slowness(["a", "b"]) == {"a": 1.0, "b": 1.0}  # nothing known: alike
    pace.observe("a", 1.0)
    pace.observe("b", 2.0)
    pace.observe("b", 4.0)  # 2 + 0.5 * (4 - 2) = 3
    assert pace.slowness(["a", "b", "c"]) == {"a": 1.0, "b": 3.0, "c": 1.0}  # c: no mean yet
    for _ in range(10):
        pace.observe("b", 100.0)
    assert pace.slowness(["a", "b"])["b"] == 4.0  # capped
    assert pace.slowness(["b"]) == {"b": 1.0}  # relative to the candidates offered


def test_pace_counts_from_a_few_answers_and_forgets_an_old_one() -> None:
    now = [0.0]
    pace = Pace(lambda: now[0], weight=0.2, min_samples=3, stale=60.0)
    for seconds in (1.0, 1.0, 1.0):
        pace.observe("a", seconds)
    pace.observe("b", 4.0)
    pace.observe("b", 6.0)
    assert pace.slowness(["a", "b"]) == {"a": 1.0, "b": 1.0}  # two answers of b: not yet a mean
    pace.observe("b", 8.0)
    assert pace.slowness(["a", "b"]) == {"a": 1.0, "b": 6.0}  # the first three averaged plainly: (4+6+8)/3
    pace.observe("b", 1.0)  # still a plain mean while 1/n > 0.2: 6 + (1 - 6) / 4
    assert pace.slowness(["a", "b"])["b"] == 4.75
    pace.observe("b", 4.75)
    pace.observe("b", 9.75)  # from the sixth answer on, weighted: 4.75 + 0.2 * (9.75 - 4.75) = 5.75
    assert pace.slowness(["a", "b"])["b"] == 5.75
    now[0] = 50.0
    pace.observe("a", 1.0)
    now[0] = 61.0  # b answered nothing for more than 60 s: its mean says nothing now
    assert pace.slowness(["a", "b"]) == {"a": 1.0, "b": 1.0}
    pace.observe("b", 1.0)  # and it starts again from its next answers
    assert pace._count["b"] == 1 and pace._mean["b"] == 1.0


def slowed(r: CacheAwareRouter, pool: list[Fake], slow: Fake, factor: float = 5.0) -> None:
    """Each replica has answered five calls: ``slow`` ``factor`` times slower than the rest."""
    for replica in pool:
        for _ in range(5):
            r.observe(replica.id, factor if replica is slow else 1.0)


def test_a_session_leaves_a_slow_replica_whatever_its_load() -> None:
    r = router()  # the default gate (1.5, 8) and slow factor (3)
    pool = replicas(0, 0, 0, 0)
    homes = {f"s{i}": r.route(pool, session=f"s{i}").replica for i in range(8)}
    slow = homes["s0"]
    chain = prefix_chain(chat("unnamed agent, turn 1"))
    assert r.route(pool, prefix=chain).replica is slow  # (its turn in the ties)
    for replica in pool:
        replica.in_flight = 1  # each session waits for its answer: the slow one holds no more calls
    slowed(r, pool, slow)
    stays = r.route(pool, session="s1")
    assert stays.replica is homes["s1"] is not slow and stays.reason == "session"
    moved = r.route(pool, session="s0")  # 1 x 5 = 5, far within 1 * 1.5 + 8: the gate alone would keep it
    assert moved.replica is not slow and moved.reason == "rebalanced"
    again = r.route(pool, session="s0")
    assert again.replica is moved.replica and again.reason == "session"  # no flapping back
    unnamed = r.route(pool, prefix=prefix_chain(chat("unnamed agent, turn 1", "done", "turn 2")))
    assert unnamed.replica is not slow and unnamed.reason == "rebalanced"  # its prefix was there: it leaves too
    slow.in_flight = 0  # idle, the slow one still gets nothing new while a brisk one is usable
    fresh = [r.route(pool, session=f"new-{i}") for i in range(6)]
    assert all(f.replica is not slow and f.reason == "least_loaded" for f in fresh)
    only = r.route([slow], session="s0")  # the only one usable: it serves
    assert only.replica is slow and only.reason == "failover"


def test_a_replica_a_little_slower_keeps_its_sessions() -> None:
    r = router()
    pool = replicas(0, 0)
    home = r.route(pool, session="s").replica
    slowed(r, pool, home, factor=2.5)  # within the slow factor 3
    assert r.route(pool, session="s") == type(r.route(pool, session="s"))(home, "session")
    off = router(slow_factor=0.0)  # --routing-slow-factor 0: pace only weighs the load
    home = off.route(pool, session="s").replica
    slowed(off, pool, home, factor=9.0)
    assert off.route(pool, session="s").replica is home


def test_a_slow_replica_is_tried_again_once_its_pace_is_old() -> None:
    now = [0.0]
    r = router(now)
    pool = replicas(0, 0)
    slow = r.route(pool, session="s").replica
    slowed(r, pool, slow)
    assert r.route(pool, session="s").replica is not slow
    now[0] = 30.0
    for _ in range(3):
        r.observe(next(p for p in pool if p is not slow).id, 1.0)  # the other keeps answering
    assert [r.route(pool).replica is slow for _ in range(4)] == [False] * 4
    now[0] = 61.0  # nothing from the slow one for over a minute: it may have recovered
    assert [r.route(pool).replica is slow for _ in range(4)].count(True) == 2  # both idle: turns


def test_the_gate_measures_against_the_brisk_replicas() -> None:
    r = router()
    pool = replicas(0, 0, 0)
    home = r.route(pool, session="s").replica
    slow = next(p for p in pool if p is not home)
    slowed(r, pool, slow)
    slow.in_flight = 0  # the slow one idle (its sessions left): it does not tighten the gate
    home.in_flight = 9
    next(p for p in pool if p not in (home, slow)).in_flight = 2
    kept = r.route(pool, session="s")  # 9 within 2 * 1.5 + 8 = 11 (not 0 * 1.5 + 8 = 8)
    assert kept.replica is home and kept.reason == "session"
    home.in_flight = 12
    moved = r.route(pool, session="s")
    assert moved.replica not in (home, slow) and moved.reason == "rebalanced"


def test_a_session_leaves_a_replica_that_became_slow() -> None:
    r = router(slow_factor=0.0)  # the load gate alone, pace weighing each call
    pool = replicas(0, 0, 0, 0)
    homes = {f"s{i}": r.route(pool, session=f"s{i}").replica for i in range(8)}
    slow = homes["s0"]
    for replica in pool:
        replica.in_flight = 2  # the sessions spread two by two, each waiting for its answer
        for _ in range(5):
            r.observe(replica.id, 5.0 if replica is slow else 1.0)
    assert r.route(pool, session="s1").reason == "session"  # another replica: it stays
    moved = r.route(pool, session="s0")  # 2 calls x 5 = 10, within 2 * 1.5 + 8 = 11: it stays
    assert moved.replica is slow and moved.reason == "session"
    slow.in_flight = 3  # 3 x 5 = 15 > 11: the gate moves it to a fast one
    moved = r.route(pool, session="s0")
    assert moved.replica is not slow and moved.reason == "rebalanced"
    fresh = r.route([slow, pool[1] if slow is not pool[1] else pool[2]])
    assert fresh.replica is not slow and fresh.reason == "least_loaded"  # 2 calls there weigh 2, the slow 3 weigh 15


def test_an_engines_own_queue_counts_while_its_report_is_fresh() -> None:
    now = [0.0]
    r = router(now)
    pool = replicas(0, 0)
    r.report_load("r0", EngineLoad(waiting=3))  # another client's calls queue there
    assert [r.route(pool).replica.id for _ in range(3)] == ["r1"] * 3  # least loaded: 0 against 3
    pool[1].in_flight = 4  # now r1 holds more than r0's queue
    assert r.route(pool).replica.id == "r0"
    home = r.route(replicas(0, 0), session="s").replica.id  # a session on r1 ...
    assert home == "r1"
    r.report_load("r1", EngineLoad(waiting=20))  # ... whose engine queues 20 > 0 * 1.5 + 8: the gate moves it
    moved = r.route(replicas(0, 0), session="s")
    assert moved.replica.id == "r0" and moved.reason == "rebalanced"
    now[0] = 10.5  # reports older than 10 s count no more
    assert r.route(replicas(0, 3), session="s").replica.id == "r0"
    assert [r.route(replicas(1, 0)).replica.id for _ in range(2)] == ["r1", "r1"]
    r.forget("r1")
    assert "r1" not in r.reported


def test_round_robin_ignores_the_engines_queue() -> None:
    r = RoundRobinRouter(lambda: 0.0)
    r.report_load("r0", EngineLoad(waiting=100))
    assert [r.route(replicas(0, 0)).replica.id for _ in range(2)] == ["r0", "r1"]


def test_a_replica_that_leaves_is_forgotten() -> None:
    r = router()
    pool = replicas(0, 0)
    chain = prefix_chain(chat("x"))
    home = r.route(pool, prefix=chain).replica
    r.observe(home.id, 3.0)
    r.forget(home.id)
    assert r.index.size(home.id) == 0 and r.pace.slowness([home.id]) == {home.id: 1.0}
    assert r.pace._mean == {}


def test_round_robin_ignores_pace() -> None:
    r = RoundRobinRouter(lambda: 0.0)
    pool = replicas(0, 0)
    r.observe("r0", 100.0)
    assert [r.route(pool).replica.id for _ in range(2)] == ["r0", "r1"]


# -- round-robin: the behaviour before routing --------------------------------------------


def test_round_robin_takes_turns_and_keeps_sessions() -> None:
    r = RoundRobinRouter(lambda: 0.0)
    pool = replicas(5, 0, 0)  # load is not looked at
    assert [r.route(pool).replica.id for _ in range(4)] == ["r0", "r1", "r2", "r0"]
    stuck = r.route(pool, session="s1")
    assert [r.route(pool, session="s1").replica for _ in range(3)] == [stuck.replica] * 3
    assert r.route(pool, session="s1").reason == "session"
    pool[0].in_flight = 1000  # no gate in round-robin
    assert r.route(pool, session="s1").replica is stuck.replica
    rest = [c for c in pool if c is not stuck.replica]
    assert r.route(rest, session="s1", failover=True).reason == "failover"
    assert r.route(pool, prefix=(1, 2, 3)).reason == "round_robin"


# -- the chain of a long body, off the event loop ------------------------------------------


def test_a_long_body_is_hashed_in_a_worker_thread_and_a_busy_pool_routes_without_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import asyncio
    import threading

    from gateway.generation import offload
    from gateway.upstream import attempts

    long = chat(*[f"turn {i}" for i in range(attempts.CHAIN_ON_LOOP_MESSAGES + 10)])
    short = chat("hi")
    threads: list[str] = []
    real = attempts.prefix_chain

    def spy(body: dict) -> tuple[int, ...]:
        threads.append(threading.current_thread().name)
        return real(body)

    monkeypatch.setattr(attempts, "prefix_chain", spy)
    assert asyncio.run(attempts._prefix_of(short)) == real(short)
    assert threads == [threading.main_thread().name]  # a usual body: on the loop
    assert asyncio.run(attempts._prefix_of(long)) == real(long)
    assert threads[1].startswith("codebuddy2api-bodies")  # a long one: in a worker
    full = offload.Offload("full", workers=1, max_pending=0)
    monkeypatch.setattr(attempts, "BODIES", full)
    assert asyncio.run(attempts._prefix_of(long)) == ()  # no worker free: routed by load alone


def test_keys_of_one_engine_share_its_affinity_and_take_turns() -> None:
    """Two keys of one upstream reach one engine (one prefix cache): the router sees one
    replica, and the engine spreads its calls over its keys (fewest in flight, then in turn)."""
    from types import SimpleNamespace

    from gateway.upstream.routing import engines_of

    a1, a2 = SimpleNamespace(id="a1", in_flight=0, url="A"), SimpleNamespace(id="a2", in_flight=0, url="A")
    b1 = SimpleNamespace(id="b1", in_flight=0, url="B")
    engines = engines_of([a1, b1, a2], lambda c: c.url)
    assert [(e.id, [c.id for c in e.credentials]) for e in engines] == [("A", ["a1", "a2"]), ("B", ["b1"])]
    assert engines[0].in_flight == 0
    assert [engines[0].pick(turn).id for turn in range(4)] == ["a1", "a2", "a1", "a2"]
    a1.in_flight = 3
    assert engines[0].in_flight == 3 and engines[0].pick(0).id == "a2"
    router = CacheAwareRouter(lambda: 0.0)
    first = router.route(engines, session="s", prefix=(1, 2))
    again = router.route(engines_of([a1, b1, a2], lambda c: c.url), session="s", prefix=(1, 2))
    assert again.replica.id == first.replica.id and again.reason == "session"
