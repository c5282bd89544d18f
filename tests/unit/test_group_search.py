"""How a round's matchmaking finds the others (collabopt/engine/group_search.py): DHT stores and lookups within
bounded waits, and the declarations of peers met before, asked directly, as hivemind's GroupKeyManager reads them."""

from __future__ import annotations

import asyncio
import functools
import math
from types import SimpleNamespace

import pytest
from hivemind.averaging.key_manager import GroupKeyManager
from hivemind.averaging.matchmaking import Matchmaking
from hivemind.p2p import PeerID, ServicerBase
from hivemind.proto import averaging_pb2
from hivemind.utils import ValueWithExpiration, get_dht_time

from collabopt.engine import group_search
from collabopt.engine.averager import AveragingService, _Search
from collabopt.engine.gather_exchange import ExchangeService
from collabopt.engine.group_search import PeerHints, RoundMatchmaking, SearchDHT, declared_expiration

ALICE, BOB, CAROL = (PeerID.from_base58(text) for text in (
    "QmXfzzKcYg6ARUVzmWz1CjJzUHMMF7i7CuBfi1W8gwjEP4", "QmNLei78zWmzUdbeRB3CiUfAizWUrbeeZh5K1rhAQKCh51",
    "QmRTdBeGgZG2xdBqHdDs5sBHQnKpc5Rm7cKXgbKXYTyJwN"))
KEY = "run_grad_averager.0b"
MATCHMAKING_TIME = 60.0


@pytest.fixture(autouse=True)
def short_waits(monkeypatch):
    monkeypatch.setattr(group_search, "LOOKUP_WAIT", 0.05)
    monkeypatch.setattr(group_search, "PACE", 0.0)
    monkeypatch.setattr(group_search, "ASK_EVERY", 0.0)


class SilentDHT:
    """A DHT whose stores and lookups wait for a node that does not answer: they end when the test says so."""

    def __init__(self):
        self.peer_id = ALICE
        self.stores, self.lookups = [], []

    def store(self, **kwargs):
        self.stores.append(asyncio.get_running_loop().create_future())
        return self.stores[-1]

    def get(self, key, latest, return_future):
        self.lookups.append(asyncio.get_running_loop().create_future())
        return self.lookups[-1]


def search_dht(dht, hints=(), answers=None):
    peer_hints = PeerHints()
    peer_hints.add(hints)
    search = SearchDHT(dht, None, schema_hash=b"schema", prefix="run_grad_averager", hints=peer_hints,
                       entry=lambda: b"", matchmaking_time=MATCHMAKING_TIME)
    asked = []

    async def ask(peer, key):
        asked.append(peer)
        answer = (answers or {}).get(peer)
        if answer == "silent":
            await asyncio.sleep(3600)
        return answer

    search._ask = ask
    return search, asked


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_a_declaration_whose_store_waits_for_a_silent_node_returns_and_the_store_goes_on():
    async def go():
        dht = SilentDHT()
        search, _ = search_dht(dht)
        declared = await search.store(key=KEY, subkey=ALICE.to_bytes(), value=True, expiration_time=1.0)
        return declared, dht.stores[0].done()

    assert run(go()) == (True, False)


def test_a_peer_met_before_is_found_by_its_own_answer_while_the_dht_lookup_waits():
    async def go():
        expiration = get_dht_time() + 30
        search, _ = search_dht(SilentDHT(), hints=[BOB], answers={BOB: expiration})
        found = await GroupKeyManager(search, "run_grad_averager", "", None).get_averagers(KEY, only_active=True)
        return found, expiration

    found, expiration = run(go())
    assert found == [(BOB, expiration)]


def test_a_slow_lookup_answers_a_later_search_and_its_declarations_count_until_they_end():
    async def go():
        dht = SilentDHT()
        search, _ = search_dht(dht)
        first = await search.get(KEY, latest=True)
        carol = ValueWithExpiration(True, get_dht_time() + 30)
        dht.lookups[0].set_result(ValueWithExpiration({CAROL.to_bytes(): carol}, carol.expiration_time))
        second = await search.get(KEY, latest=True)
        lookups = len(dht.lookups)
        third = await search.get(KEY, latest=True)  # (a new lookup began, and waits)
        await asyncio.sleep(0.01)
        return first, second, third, (lookups, len(dht.lookups)), search.hints.peers()

    first, second, third, lookups, hints = run(go())
    assert first is None and list(second.value) == [CAROL.to_bytes()] and third.value == second.value
    assert lookups == (1, 2)  # (none started twice)
    assert hints == [CAROL]  # (a peer the DHT returned is asked directly from then on)


def test_a_peer_that_does_not_answer_is_left_alone_for_a_while():
    async def go():
        search, asked = search_dht(SilentDHT(), hints=[BOB, CAROL], answers={BOB: "silent", CAROL: None})
        for _ in range(3):
            await search.get(KEY, latest=True)
        return asked

    asked = run(go())
    assert asked.count(BOB) == 1 and asked.count(CAROL) == 3


async def hold_the_lookup(search, dht, monkeypatch):
    """Let ``search`` see a lookup take longer than LOOKUP_WAIT (a node on the key's path does not answer), then make
    LOOKUP_WAIT an hour: a search that waited for a lookup from then on would outlast run()'s 10 s."""
    await search.get(KEY, latest=True)
    await asyncio.sleep(2 * group_search.LOOKUP_WAIT)
    dht.lookups[-1].set_result(None)
    await asyncio.sleep(0.01)  # (its end is news)
    await search.get(KEY, latest=True)  # (takes the held lookup's answer and the news)
    monkeypatch.setattr(group_search, "LOOKUP_WAIT", 3600.0)


def test_while_lookups_are_held_up_a_search_waits_only_for_the_peers_that_answer(monkeypatch):
    """Once a lookup took longer than LOOKUP_WAIT, a search hands on the answers as they come, waiting neither for
    the next lookup nor for a peer that did not answer its last request: a declaration lasts ``matchmaking_time``,
    and one handed on a wait late may have ended."""
    monkeypatch.setattr(group_search, "ASK_BACKOFF", 0.0)

    async def go():
        expiration = get_dht_time() + 30
        dht = SilentDHT()
        search, asked = search_dht(dht, hints=[BOB, CAROL], answers={BOB: expiration, CAROL: "silent"})
        await hold_the_lookup(search, dht, monkeypatch)
        return await search.get(KEY, latest=True), expiration, asked

    found, expiration, asked = run(go())
    assert found.value == {BOB.to_bytes(): ValueWithExpiration(True, expiration)}
    assert asked.count(CAROL) >= 2  # (asked again, in the background)


def test_a_peer_whose_answered_declaration_ends_is_asked_again_at_once_within_the_search(monkeypatch):
    """A search under way asks a peer again as its declaration ends (it declares anew), and returns the new one."""
    monkeypatch.setattr(group_search, "ASK_EVERY", 3600.0)

    async def go():
        dht = SilentDHT()
        search, asked = search_dht(dht, hints=[BOB])
        declarations = iter([get_dht_time() + 3.0, get_dht_time() + 30])
        search._ask = lambda peer, key: asked.append(peer) or asyncio.sleep(0, next(declarations))
        await hold_the_lookup(search, dht, monkeypatch)
        second = await search.get(KEY, latest=True)
        return second, asked

    second, asked = run(go())
    assert asked == [BOB, BOB] and second.value[BOB.to_bytes()].expiration_time > get_dht_time() + 20


def test_a_lookup_that_answers_in_time_is_waited_for_with_the_answers_one_view(monkeypatch):
    """Where lookups answer within LOOKUP_WAIT, a search returns the DHT's declarations and the peers' answers
    together (one view: every peer orders its candidate leaders alike, and none waits in a circle of requests)."""
    monkeypatch.setattr(group_search, "LOOKUP_WAIT", 5.0)  # (it returns as soon as both are in)

    async def go():
        dht = SilentDHT()
        search, _ = search_dht(dht, hints=[BOB], answers={BOB: get_dht_time() + 30})
        search_task = asyncio.ensure_future(search.get(KEY, latest=True))
        await asyncio.sleep(0.01)  # (BOB answered; the lookup not yet)
        carol = ValueWithExpiration(True, get_dht_time() + 30)
        dht.lookups[0].set_result(ValueWithExpiration({CAROL.to_bytes(): carol}, carol.expiration_time))
        return await search_task

    assert set(run(go()).value) == {BOB.to_bytes(), CAROL.to_bytes()}


def test_a_peer_whose_answer_had_ended_already_is_asked_again_only_after_a_while(monkeypatch):
    """An answer already past its end (a peer late to declare anew, or clocks apart) is not asked for again at every
    search: only after :data:`ASK_EVERY`."""
    monkeypatch.setattr(group_search, "ASK_EVERY", 3600.0)

    async def go():
        search, asked = search_dht(SilentDHT(), hints=[BOB], answers={BOB: get_dht_time() - 1.0})
        for _ in range(5):
            await search.get(KEY, latest=True)
        return asked

    assert run(go()) == [BOB]


def test_a_peer_answers_its_declaration_under_the_key_only_while_it_looks_for_a_group():
    leaders = SimpleNamespace(declared_group_key=KEY, declared_expiration_time=123.0)
    done = SimpleNamespace(done=lambda: False)
    looking = SimpleNamespace(client_mode=False, is_looking_for_group=True, assembled_group=done,
                              potential_leaders=leaders)
    assert declared_expiration(looking, KEY) == 123.0
    assert declared_expiration(looking, KEY + "1") is None
    assert declared_expiration(None, KEY) is None
    assert declared_expiration(SimpleNamespace(**vars(looking) | dict(is_looking_for_group=False)), KEY) is None
    assert declared_expiration(SimpleNamespace(**vars(looking) | dict(client_mode=True)), KEY) is None
    assembled = SimpleNamespace(**vars(looking) | dict(assembled_group=SimpleNamespace(done=lambda: True)))
    assert declared_expiration(assembled, KEY) is None
    undeclared = SimpleNamespace(declared_group_key=KEY, declared_expiration_time=math.inf)
    assert declared_expiration(SimpleNamespace(**vars(looking) | dict(potential_leaders=undeclared)), KEY) is None


def test_hints_keep_the_most_recent_peers():
    hints = PeerHints()
    peers = [PeerID(bytes([i]) * 34) for i in range(group_search.HINTS_KEPT + 2)]
    hints.add(peers)
    hints.add([peers[0]])
    assert hints.peers() == peers[3:] + [peers[0]]


def test_hints_keep_the_callers_apart_so_that_fresh_ids_never_push_out_the_peers_met():
    hints = PeerHints()
    met = [PeerID(bytes([i]) * 34) for i in range(group_search.HINTS_KEPT)]
    hints.add(met)
    callers = [PeerID(bytes([100 + i]) * 34) for i in range(50)]
    for caller in callers:
        hints.add_caller(caller)
    hints.add_caller(met[0])  # (a peer met already stays among those met)
    assert hints.peers() == met + callers[-group_search.CALLERS_KEPT:]


class Stub:
    def __init__(self, expiration):
        self.expiration = expiration

    async def rpc_declaration(self, request):
        return SimpleNamespace(schema_hash=request.schema_hash, group_key=request.group_key,
                               expiration=self.expiration)


@pytest.mark.parametrize("offset, counted", [(10.0, True), (math.inf, False), (-math.inf, False), (math.nan, False),
                                             (1e9, "clamped"), (None, False)])
def test_a_direct_answers_end_of_search_counts_up_to_matchmaking_time_from_now(monkeypatch, offset, counted):
    now = get_dht_time()
    expiration = 0.0 if offset is None else now + offset
    monkeypatch.setattr(group_search.DeclarationService, "get_stub",
                        classmethod(lambda cls, p2p, peer, namespace: Stub(expiration)))
    search = SearchDHT(SilentDHT(), None, schema_hash=b"schema", prefix="run_grad_averager", hints=PeerHints(),
                       entry=lambda: b"", matchmaking_time=MATCHMAKING_TIME)
    answer = run(search._ask(BOB, KEY))
    if counted is False:
        assert answer is None
    elif counted == "clamped":
        assert now < answer <= get_dht_time() + MATCHMAKING_TIME + group_search.CLOCK_ALLOWANCE
    else:
        assert answer == expiration


def test_what_a_search_keeps_of_the_peers_it_asked_stays_bounded(monkeypatch):
    monkeypatch.setattr(group_search, "ASK_BACKOFF", 0.0)

    async def go():
        search, _ = search_dht(SilentDHT())
        sizes = []
        for i in range(60):  # fresh callers, one after the other, half of them silent
            peer = PeerID(bytes([0x12, 0x20]) + i.to_bytes(2, "big") * 16)
            search.hints.add_caller(peer)
            search._ask = functools.partial(silent_or_answer, i % 2)
            await search.get(KEY, latest=True)
            sizes.append((len(search._answers), len(search._quiet_until)))
        return sizes

    sizes = run(go())
    assert max(answers for answers, _ in sizes) <= group_search.CALLERS_KEPT
    assert max(quiet for _, quiet in sizes) <= group_search.CALLERS_KEPT


async def silent_or_answer(silent, peer, key):
    if silent:
        await asyncio.sleep(3600)
    return get_dht_time() + 30


@pytest.mark.parametrize("service_type", [AveragingService, ExchangeService])
def test_a_caller_joins_the_hints_only_for_tensors_this_peer_averages(service_type):
    """Both services answer the peers that ask for their declaration (the exchange's search is paced as the averaging
    service's), and only for their own tensors or settings."""
    not_looking = SimpleNamespace(client_mode=True)
    service = SimpleNamespace(_key=None, _hints=PeerHints(), _matchmakings={b"schema": not_looking},
                              schema=b"schema", _matchmaking=not_looking, prefix="run")
    request = SimpleNamespace(schema_hash=b"other", group_key=KEY, gather=b"")
    assert service_type._declaration(service, request, SimpleNamespace(remote_id=BOB)) is None
    assert service._hints.peers() == []
    request.schema_hash = b"schema"
    assert service_type._declaration(service, request, SimpleNamespace(remote_id=BOB)) is None  # (not looking)
    assert service._hints.peers() == [BOB]


class LateLeader(ServicerBase):
    """A leader that accepts at once (or never answers: ``accepts`` False) and gives its verdict, a group with the
    follower in it, ``late`` seconds after the end of the follower's search."""

    accepts, late = True, 0.0

    @classmethod
    def get_stub(cls, p2p, peer, *, namespace=None):
        return SimpleNamespace(rpc_join_group=functools.partial(cls.answers, peer))

    @classmethod
    async def answers(cls, leader, request):
        async def messages():
            if not cls.accepts:
                await asyncio.sleep(3600)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
            await asyncio.sleep(max(0.0, request.expiration - get_dht_time()) + cls.late)
            yield averaging_pb2.MessageFromLeader(
                code=averaging_pb2.BEGIN_ALLREDUCE, group_id=b"group", gathered=[b"", b""],
                ordered_peer_ids=[leader.to_bytes(), BOB.to_bytes()])
        return messages()


def follow(matchmaking_class, accepts=True, late=0.3, **kwargs):
    """What a follower (BOB) of a :class:`LateLeader` (ALICE) gets from its join request: the group, or None."""
    LateLeader.accepts, LateLeader.late = accepts, late

    async def go():
        node = SimpleNamespace(peer_id=BOB)
        matchmaking = matchmaking_class(
            node, b"schema", node, servicer_type=LateLeader, prefix="run", target_group_size=None, min_group_size=2,
            min_matchmaking_time=0.2, request_timeout=0.1, client_mode=False, **kwargs)
        step = SimpleNamespace(scheduled_time=get_dht_time() + 0.2, data_for_gather=b"")
        async with matchmaking.looking_for_group(step):
            return await matchmaking._request_join_group(ALICE)

    return run(go())


def test_a_follower_waits_for_its_leaders_verdict_longer_than_the_request_timeout():
    """A follower paused past its end of search plus the request timeout when its leader's verdict came (a busy
    machine) gave up on a leader whose group counted it (hivemind's); collabopt's follower waits ``patience``."""
    assert follow(Matchmaking) is None  # (hivemind's: the leader counts it, it is not there)
    group = follow(RoundMatchmaking, patience=5.0)
    assert group is not None and set(group.peer_ids) == {ALICE, BOB}
    assert follow(RoundMatchmaking, late=0.0, patience=0.0) is not None  # (at least the request timeout)


def test_a_follower_still_waits_only_the_request_timeout_for_the_leaders_first_answer():
    """The first answer keeps hivemind's short timeout: it breaks two peers' requests to each other."""
    assert follow(RoundMatchmaking, accepts=False, patience=3600.0) is None


def test_a_followers_patience_is_the_rounds_wait_for_a_member_but_at_most_a_search_and_a_request():
    assert group_search.verdict_patience(2.0, 2.0, 1.0) == 2.0  # (the round leaves a member out after 2 s anyway)
    assert group_search.verdict_patience(28.8, 5.0, 3.0) == 8.0  # (a large model's wait: a leader that late is gone)


def test_hiveminds_matchmaking_reads_request_timeout_only_where_round_matchmaking_expects():
    """RoundMatchmaking's property changes the verdict's wait only while no other method of hivemind's matchmaking
    reads request_timeout (with current_leader set): a release that adds a read fails here, to be reviewed."""
    import inspect

    readers = sorted(name for name, member in vars(Matchmaking).items() if inspect.isfunction(member)
                     and "request_timeout" in inspect.getsource(member))
    assert readers == ["__init__", "_request_join_group"]


def test_both_services_match_with_round_matchmaking():
    """The averaging service's rounds and the all-gather exchange (compressed DiLoCo) both wait for a late verdict."""
    import inspect

    from collabopt.engine import averager, gather_exchange

    for source in (inspect.getsource(averager.AveragingService._matchmaker),
                   inspect.getsource(gather_exchange.ExchangeService._start)):
        assert "RoundMatchmaking(" in source and "verdict_patience(" in source


class QuietDHT:
    """A DHT whose stores succeed at once and whose lookups find nobody: a leader alone in its search."""

    def __init__(self, peer_id):
        self.peer_id = peer_id

    async def store(self, **kwargs):
        return True

    async def get(self, *args, **kwargs):
        return None


# join_a_busy_leader's leader: its request timeout and the length of its search. Seconds, not tenths: an acceptance
# within half the request timeout must stay within it when the test process stalls (a loaded 2-core machine stalled
# one past 0.2 s, where the lock was held 0.05 s)
BUSY_LEADER_REQUEST_TIMEOUT, BUSY_LEADER_SEARCH = 2.0, 2.5


def join_a_busy_leader(busy: float, gate: bool = True):
    """What BOB's join request gets from a leader (ALICE, hivemind's matchmaking in collabopt's gate, groups of 2,
    request timeout and search above) whose lock is held ``busy`` seconds as it comes (as while the leader asks a
    leader itself), and the group ALICE's search returned (None: none)."""
    async def go():
        node = QuietDHT(ALICE)
        matchmaking = RoundMatchmaking(
            node, b"schema", node, servicer_type=LateLeader, prefix="run", target_group_size=2, min_group_size=2,
            min_matchmaking_time=BUSY_LEADER_SEARCH, request_timeout=BUSY_LEADER_REQUEST_TIMEOUT, client_mode=False,
            patience=0.0)
        end = get_dht_time() + BUSY_LEADER_SEARCH
        search = asyncio.ensure_future(matchmaking.look_for_group(
            _Search(scheduled_time=end, deadline=end, data_for_gather=b"")))
        while matchmaking.potential_leaders.declared_group_key is None:
            await asyncio.sleep(0.01)
        request = averaging_pb2.JoinRequest(schema_hash=b"schema", expiration=get_dht_time() + 10.0, gather=b"",
                                            group_key=matchmaking.group_key_manager.current_key)
        context = SimpleNamespace(remote_id=BOB)
        answers = AveragingService._matchmaking_for(
            SimpleNamespace(_matchmakings={b"schema": matchmaking}, _key=None, prefix="run"), b"schema"
        ).rpc_join_group(request, context) if gate else matchmaking.rpc_join_group(request, context)
        async with matchmaking.lock_request_join_group:
            first = asyncio.ensure_future(answers.__anext__())
            await asyncio.sleep(busy)
        codes = [(await first).code] + [message.code async for message in answers]
        return codes, await search

    return run(go())


def test_a_leader_withdraws_an_acceptance_that_comes_after_half_the_request_timeout():
    """Two peers that ask each other both wait for their lock; the follower gives up after ``request_timeout``:
    hivemind's leader, its lock free, then counted a follower already gone, and assembled its group with it."""
    late = 0.6 * BUSY_LEADER_REQUEST_TIMEOUT  # (after half the request timeout, well within the search)
    codes, group = join_a_busy_leader(late, gate=False)  # (hivemind's matchmaking alone: BOB is counted)
    assert codes == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE] and BOB in group.peer_ids
    codes, group = join_a_busy_leader(late)
    assert codes == [averaging_pb2.BAD_EXPIRATION_TIME] and group is None
    codes, group = join_a_busy_leader(0.05)  # (within half the request timeout: accepted as before)
    assert codes == [averaging_pb2.ACCEPTED, averaging_pb2.BEGIN_ALLREDUCE] and set(group.peer_ids) == {ALICE, BOB}
