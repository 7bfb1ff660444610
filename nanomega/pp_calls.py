"""A pipeline rank's point-to-point calls in flight, and Megatron's deallocate trick.

Idea: a rank posts the sends and receives planned between two ops (schedules.rank_plan) as one
batched isend/irecv call through the pp Axis and keeps it in flight; an op waits only for the call
that holds its input, and a call for the earlier ones to the same peer, so a zero-bubble W runs while
messages travel. A forward output that was sent is needed again only through its grad_fn, so its
storage is freed once the call completed (Megatron's deallocate), and the backward is started from
the autograd engine directly, which accepts a gradient whose shape differs from the freed output.

Formula: a sent output (mb, s, h) freed once sent saves mb s h element bytes per micro-batch in flight.
Lesson: lessons/08-pipeline-parallel.md
"""

import functools

import torch

from .schedules import peer


class Calls:
    """This rank's batched p2p calls in flight (schedules.simulate's model): an op waits for the
    call holding its input, a call for the earlier ones to the same peer; a sent output is freed
    once its call completed (its autograd graph needs only the grad_fn: Megatron's deallocate).
    Without W ops (eager False) every call is waited for as it is posted: the next op needs it."""

    def __init__(self, grid, p, rank, deallocate, eager, place="loop"):
        self.grid, self.deallocate, self.eager = grid, deallocate, eager
        self.peer = functools.partial(peer, p=p, rank=rank, place=place)  # msg -> the other end
        self.calls = []  # (works, peers, receives, [(message, tensor) sent])

    def post(self, step, sent, inbox):
        peers = {self.peer(msg) for msg in step.sends + step.recvs}
        for call in [c for c in self.calls if c[1] & peers]:
            self.wait(call)
        works = self.grid.pp.p2p(
            sends=[(t, self.peer(msg)) for msg, t in zip(step.sends, sent)],
            recvs=[(inbox[msg], self.peer(msg)) for msg in step.recvs],
            wait=False,
        )
        # every sent tensor stays referenced until its call completes; forward outputs freed then
        self.calls.append((works, peers, set(step.recvs), list(zip(step.sends, sent))))
        if not self.eager:
            self.wait_all()

    def wait_for(self, msg):
        for call in [c for c in self.calls if msg in c[2]]:
            self.wait(call)

    def wait_all(self):
        for call in list(self.calls):
            self.wait(call)

    def wait(self, call):
        self.calls = [c for c in self.calls if c is not call]  # by identity: calls hold tensors
        for work in call[0] or []:
            work.wait()
        for msg, t in call[3] if self.deallocate else []:
            if msg[0] == "F" and t._base is None:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def backward(out, grad):
    """Backward from out with gradient grad. Calls the autograd engine directly, as Megatron's
    custom_backward: torch.autograd.backward would reject a grad whose shape differs from the
    deallocated out.data."""
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(out,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
