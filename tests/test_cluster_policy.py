"""The routing policy as a pure function: no Ray, no model."""

import json
from collections import Counter

import pytest
from conftest import engine_stats

from slimkv.cluster.config import ClusterConfig
from slimkv.cluster.hashing import routing_hashes
from slimkv.cluster.policy import (Balance, PrefixIndex, ReplicaLoad, RouteKeys,
                                   rendezvous_score, route, routing_stats)
from slimkv.kv.block_pool import hash_block

REPLICAS = [f"r{i}" for i in range(4)]
BALANCE = Balance.from_config(ClusterConfig())  # 12 requests, 1.5x: the defaults


def loads(names, **requests):
    return [ReplicaLoad(n, requests.get(n, 0)) for n in names]


def session_homes(names, sessions, index=None):
    index = index or PrefixIndex()
    return {s: route(RouteKeys(s), loads(names), index, BALANCE).replica for s in sessions}


def test_routing_hashes_are_the_engines_chained_block_hashes():
    ids = list(range(100))
    hashes = routing_hashes(ids, 16, max_blocks=4)
    assert len(hashes) == 4  # 6 full blocks, capped at 4; the partial block is never hashed
    parent = None
    for i, h in enumerate(hashes):
        parent = hash_block(parent, ids[16 * i:16 * (i + 1)])
        assert h == parent
    assert routing_hashes(ids[:15], 16, max_blocks=4) == ()
    changed = routing_hashes([7] + ids[1:], 16, max_blocks=4)
    assert all(a != b for a, b in zip(hashes, changed))  # chained: an early change moves all


def test_sessions_spread_over_replicas_and_stick():
    sessions = [f"sess-{i}" for i in range(400)]
    homes = session_homes(REPLICAS, sessions)
    counts = Counter(homes.values())
    assert set(counts) == set(REPLICAS)
    assert min(counts.values()) > 400 / 4 * 0.7  # rendezvous hashing spreads evenly
    assert session_homes(REPLICAS, sessions) == homes  # deterministic


def test_removing_a_replica_moves_only_its_sessions():
    sessions = [f"sess-{i}" for i in range(400)]
    before = session_homes(REPLICAS, sessions)
    after = session_homes(REPLICAS[:3], sessions)
    moved = {s for s in sessions if before[s] != after[s]}
    assert moved == {s for s in sessions if before[s] == "r3"}


def test_adding_a_replica_moves_about_one_nth_and_only_to_the_new_one():
    sessions = [f"sess-{i}" for i in range(400)]
    before = session_homes(REPLICAS, sessions)
    after = session_homes(REPLICAS + ["r4"], sessions)
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "r4" for s in moved)
    assert 400 / 5 * 0.6 < len(moved) < 400 / 5 * 1.4


def test_a_session_follows_its_home_not_shared_content():
    index = PrefixIndex()
    index.record("r0", ("doc", "more"))  # every session opens with the same document
    homes = {s: route(RouteKeys(s, ("doc", "more")), loads(REPLICAS), index, BALANCE)
             for s in (f"sess-{i}" for i in range(100))}
    assert len({d.replica for d in homes.values()}) == 4
    assert all(d.reason == "session" for d in homes.values())
    turn2 = {s: route(RouteKeys(s, ("doc", "more", "turn2")), loads(REPLICAS), index, BALANCE)
             for s in homes}
    assert {s: d.replica for s, d in turn2.items()} == {s: d.replica for s, d in homes.items()}
    assert {s: d.replica for s, d in homes.items()} == session_homes(REPLICAS, list(homes))


def test_prefix_affinity_without_session_picks_the_longest_cached_run():
    index = PrefixIndex()
    index.record("r1", ("a", "b"))
    index.record("r2", ("a", "b", "c"))
    index.record("r3", ("x", "b", "c", "d"))  # same later hashes, different first: no match
    d = route(RouteKeys(None, ("a", "b", "c", "d")), loads(REPLICAS), index, BALANCE)
    assert (d.replica, d.reason, d.matched_blocks) == ("r2", "prefix", 3)
    assert index.match("r3", ("a", "b", "c", "d")) == 0


def test_new_prompts_without_session_spread_by_their_deepest_block():
    index = PrefixIndex()
    index.record("r0", ("system",))  # a shared system prompt cached on one replica only
    counts = Counter()
    for i in range(200):
        keys = RouteKeys(None, ("system", f"doc-{i}"))
        counts[route(keys, loads(REPLICAS), index, BALANCE).replica] += 1
    assert counts["r0"] == 200  # one matching block outranks no match ...
    index.record("r1", ("system",))
    index.record("r2", ("system",))
    index.record("r3", ("system",))
    counts = Counter(route(RouteKeys(None, ("system", f"doc-{i}")), loads(REPLICAS), index,
                           BALANCE).replica for i in range(200))
    assert min(counts.values()) > 25  # ... and equal matches spread by hash, not pile up


def test_request_without_keys_goes_to_the_least_loaded():
    d = route(RouteKeys(), loads(REPLICAS, r0=5, r1=2, r2=9, r3=3), PrefixIndex(),
              BALANCE)
    assert d.replica == "r1" and d.reason == "any"
    assert d.ranked == ("r1", "r3", "r0", "r2")


@pytest.mark.parametrize("home_load, least_load, yields", [
    (12, 0, False),   # 12 more: not over the absolute threshold
    (13, 0, True),    # 13 more, and 13 > 1.5 * 0
    (40, 27, False),  # 13 more, but 40 < 1.5 * 27 = 40.5
    (41, 27, True),
])
def test_affinity_yields_to_load_past_both_thresholds(home_load, least_load, yields):
    index = PrefixIndex()
    home = route(RouteKeys("s"), loads(["a", "b"]), index, BALANCE).replica
    other = "b" if home == "a" else "a"
    d = route(RouteKeys("s"), [ReplicaLoad(home, home_load), ReplicaLoad(other, least_load)],
              index, Balance(abs_requests=12, rel=1.5))
    assert d.replica == (other if yields else home)
    assert d.reason == ("load" if yields else "session")


def test_kv_pressure_moves_work_to_a_replica_below_the_watermark():
    index = PrefixIndex()
    index.record("r0", ("a",))
    replicas = [ReplicaLoad("r0", 3, 0.72, True), ReplicaLoad("r1", 3, 0.2)]
    d = route(RouteKeys("s", ("a",)), replicas, index, BALANCE)
    assert (d.replica, d.reason) == ("r1", "kv")
    replicas = [ReplicaLoad("r0", 3, 0.72, True), ReplicaLoad("r1", 3, 0.71, True)]
    assert route(RouteKeys("s", ("a",)), replicas, index, BALANCE).replica == "r0"  # no better


def test_replica_routing_stats_come_from_the_engine_snapshot_and_drive_the_router():
    """The two ends of Serve's routing stats: what a replica reports from its engine's
    ``EngineStats`` and the load the router reads back from that dict."""
    busy = routing_stats(engine_stats(num_running=9, num_waiting=8, num_free_blocks=2,
                                      watermark_alert=True, step=41))
    idle = routing_stats(engine_stats(num_running=1, num_free_blocks=9))
    assert json.loads(json.dumps(busy)) == busy  # plain data: it crosses Ray as is
    assert (busy["num_requests"], busy["kv_usage"], busy["num_blocks"]) == (17, 0.8, 10)
    index = PrefixIndex()
    home = route(RouteKeys("s"), loads(["a", "b"]), index, BALANCE).replica
    other = "b" if home == "a" else "a"
    assert ReplicaLoad.from_routing_stats(home, busy) == ReplicaLoad(home, 17, 0.8, True)
    # the router's own outstanding count wins when larger; no report yet reads as idle
    assert ReplicaLoad.from_routing_stats(other, idle, outstanding=3) == ReplicaLoad(other, 3, 0.1)
    assert ReplicaLoad.from_routing_stats(other, None) == ReplicaLoad(other)
    d = route(RouteKeys("s"), [ReplicaLoad.from_routing_stats(home, busy),
                               ReplicaLoad.from_routing_stats(other, idle)], index, BALANCE)
    assert (d.replica, d.reason) == (other, "kv")  # the home is over its KV watermark
    calm = routing_stats(engine_stats(num_running=17, num_free_blocks=5))
    d = route(RouteKeys("s"), [ReplicaLoad.from_routing_stats(home, calm),
                               ReplicaLoad.from_routing_stats(other, idle)], index, BALANCE)
    assert (d.replica, d.reason) == (other, "load")  # 17 vs 1: past 12 and 1.5x


def test_prefix_index_is_bounded_lru_and_forgets_dead_replicas():
    index = PrefixIndex(capacity=3)
    index.record("r0", ("a", "b", "c"))
    index.record("r0", ("a", "d"))  # "a" refreshed, "b" is now the oldest and goes
    assert index.num_blocks("r0") == 3
    assert index.match("r0", ("a", "b")) == 1 and index.match("r0", ("a", "d")) == 2
    index.drop("r0")
    assert index.match("r0", ("a",)) == 0 and index.replicas() == []


def test_rendezvous_score_is_stable_and_balance_is_validated():
    assert rendezvous_score("k", "r") == rendezvous_score("k", "r")
    assert rendezvous_score("k", "r") != rendezvous_score("k", "q")
    with pytest.raises(ValueError):
        Balance(abs_requests=12, rel=0.5)
    with pytest.raises(ValueError):
        route(RouteKeys("s"), [], PrefixIndex(), BALANCE)


def test_cluster_config_is_validated_naming_the_key():
    from slimkv.config import Config, ConfigError

    assert Config.from_dict({"cluster": {"replicas": 2}}).cluster.replicas == 2
    for bad, key in (({"replicas": 0}, "cluster.replicas"), ({"router": "random"}, "cluster.router"),
                     ({"balance_rel": 0.5}, "cluster.balance_rel"), ({"replica": 2}, "cluster.replica")):
        with pytest.raises(ConfigError, match=key):
            Config.from_dict({"cluster": bad})
