"""The Python API for training in a swarm: wrap your model (and optimizer) and call ``step``.

Two algorithms, one shape of API, both driven from your own training loop in a worker thread
while the node's event loop serves peers::

    diloco = DiLoCo(swarm, model, inner_steps=50, outer_lr=0.7, outer_momentum=0.9)
    for inputs, targets in batches:             # your loop, your inner optimizer
        model.loss(inputs, targets).backward()
        inner.step(); inner.zero_grad()
        diloco.step(samples=len(inputs))        # every 50th call: one outer round with the group

    sync = SyncDataParallel(swarm, model, optimizer, target_batch_size=256)
    for inputs, targets in batches:
        model.loss(inputs, targets).backward()
        sync.step(samples=len(inputs))          # averages gradients, then optimizer.step()

Each replicated state (DiLoCo: the global parameters and the outer momentum; sync: the parameters
and the optimizer's state) is published after every round with its checksum; before a round a
replica that is behind the swarm, or holds a state fewer peers share, downloads the state from
peers instead (:meth:`Swarm.find_donors`). Lossy codecs get error feedback: what the codec drops
from a round's message is added to the next one.
"""

from __future__ import annotations

from swarmgrad.node.training.diloco import DiLoCo
from swarmgrad.node.training.replica import Replica, RoundReport
from swarmgrad.node.training.sync import SyncDataParallel

__all__ = ["DiLoCo", "Replica", "RoundReport", "SyncDataParallel"]
