"""Every round that gathers an epoch hands the averaging service the protocol's admission rule
(:func:`collabopt.engine.protocol.sync_admits`): a search this peer leads takes no peer of a later epoch. The rule
itself is tested in test_protocol.py, the gate that applies it in test_averager_gate.py, its effect among real
processes in tests/swarm/test_allreduce_service.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch

from collabopt.engine import gather_exchange, parameter_rounds
from collabopt.engine.diloco_averaging import PseudoGradientRounds, SparsePseudoGradientRounds
from collabopt.engine.gradient_rounds import GradientRounds
from collabopt.engine.powersgd_rounds import PowerSGDRounds, PowerSGDState


class Service:
    """Records what each round hands :meth:`AveragingService.schedule`."""

    def __init__(self, *args, **kwargs):
        self.calls: list[dict] = []
        self.p2p, self.client_mode = SimpleNamespace(peer_id="me"), False

    def schedule(self, template=None, **kwargs):
        self.calls.append(kwargs)
        return SimpleNamespace(on_done=lambda callback: None)


def admits(service: Service, epoch: int) -> list[bool]:
    [call] = service.calls
    assert call["gather"]["epoch"] == epoch
    return [call["admits"](theirs) for theirs in ({"epoch": epoch - 1}, {"epoch": epoch}, {"epoch": epoch + 1})]


def test_gradient_and_powersgd_rounds_take_no_peer_of_a_later_epoch():
    made = GradientRounds.__new__(GradientRounds)
    made._buffers, made._lock, made.allreduce_timeout, made.service = [torch.zeros(3)], threading.RLock(), 5.0, \
        Service()
    made.schedule_step(gather={"epoch": 4})
    assert admits(made.service, 4) == [True, True, False]
    powersgd = PowerSGDRounds.__new__(PowerSGDRounds)
    powersgd._buffers, powersgd._lock, powersgd.allreduce_timeout = [torch.zeros(32, 16)], threading.RLock(), 5.0
    powersgd.powersgd, powersgd.service = PowerSGDState([(torch.Size([32, 16]), torch.float32)], 2, seed=0), \
        Service()
    assert powersgd.powersgd.compressed
    powersgd.schedule_step(gather={"epoch": 4})
    assert admits(powersgd.service, 4) == [True, True, False]


def test_parameter_and_diloco_rounds_take_no_peer_of_a_later_epoch(monkeypatch):
    monkeypatch.setattr(parameter_rounds, "AveragingService", Service)
    rounds = parameter_rounds.ParameterRounds(None, prefix="t", matchmaking_time=1.0, timeout=30.0,
                                              sender_timeout=1.0, request_timeout=1.0)
    rounds.schedule([torch.zeros(2)], epoch=6)
    assert admits(rounds.service, 6) == [True, True, False]
    diloco = PseudoGradientRounds.__new__(PseudoGradientRounds)
    diloco.buffers, diloco.service = [torch.zeros(2)], Service()
    diloco.schedule(timeout=5.0, gather={"epoch": 2, "anchor": "x"})
    assert admits(diloco.service, 2) == [True, True, False]
    sparse = SparsePseudoGradientRounds.__new__(SparsePseudoGradientRounds)
    sparse.service = Service()
    sparse.schedule(timeout=5.0, gather={"epoch": 2, "anchor": "x"})
    assert admits(sparse.service, 2) == [True, True, False]
    # (the exchange's entries carry [gather, public key]: its gate reads the gather)
    assert gather_exchange._gathered_of([{"epoch": 3}, b"key"]) == {"epoch": 3}
    assert gather_exchange._gathered_of({"epoch": 3}) is None
