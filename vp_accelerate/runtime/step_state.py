"""One step's values on one rank, as the executor keeps them between passes.

Every map holds one kind of value, and a value that changes kind moves to another map: a posted
receive (buffer + batch) is in `posted_receives` until its batch completes; the IF partial is in
`embed_partials` until IF_REDUCE, whose handle is in `embed_reduces`; a microbatch's output-layer state
is in `output_states` from S until the big tensors can go, its loss in `losses` from when it is known.
Keys: `(mb, chunk)` for chunk values, `mb` for vocabulary values, `(op, mb, chunk)` for p2p.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from vp_accelerate.models.masks import MicrobatchMasks
from vp_accelerate.runtime.memory import ActivationMeter, PeakCount
from vp_accelerate.runtime.p2p import Batch
from vp_accelerate.runtime.step_casts import StepCasts
from vp_accelerate.schedule.ir import Op
from vp_accelerate.vocab.comm import Pending
from vp_accelerate.vocab.output_layer import OutputState, SequenceLossFn


@dataclass
class Microbatch:
    """Everything a pass needs to know about one microbatch, known before the step starts."""

    input_ids: torch.Tensor
    """[b, s] token ids."""
    labels: torch.Tensor
    """[b, s] next-token labels (already shifted; -100 where ignored)."""
    grad_scale: torch.Tensor
    """[b*s] fp32 per-token dL/dloss_n: 1/N_valid of the whole step for valid tokens, 0 otherwise."""
    position_ids: torch.Tensor
    """[b, s] positions; a restart at 0 begins a new packed document (attention stays inside documents)."""
    attention_mask: MicrobatchMasks | None = None
    """The microbatch's attention case and its mask, decided on the host (models/masks.py); None for a plain
    causal microbatch (no padding, no packed documents)."""
    loss_fn: SequenceLossFn | None = None
    """A loss of whole sequences (DPO, runtime/preference.py) that sets g from the per-token loss after C1
    (the baseline: after its cross-entropy); None = the token loss with `grad_scale`."""


@dataclass
class PostedReceive:
    """A receive buffer and the batch it was posted in (complete once the batch is)."""

    buffer: torch.Tensor
    batch: Batch


MbChunk = tuple[int, int]
P2PKey = tuple[Op, int, int]


@dataclass
class StepState:
    """Everything one rank holds during one step; made by `Executor.run`, dropped when it returns."""

    microbatches: list[Microbatch]
    act_shape: tuple[int, ...]
    """[b, s, h] of an activation exchanged between stages."""
    meter: ActivationMeter
    """Activation, stash and communication bytes held (runtime/memory.py)."""
    casts: StepCasts
    """The step's low-precision weight copies (mixed precision)."""

    # transformer chunks
    chunk_inputs: dict[MbChunk, torch.Tensor] = field(default_factory=dict)
    """Chunk input (a leaf that requires grad) from F to B, or to the SEND_GRAD that sends its grad."""
    chunk_outputs: dict[MbChunk, torch.Tensor] = field(default_factory=dict)
    """Chunk output (with its graph) from F to B."""
    local_grads: dict[MbChunk, torch.Tensor] = field(default_factory=dict)
    """∂L/∂input of (mb, chunk) from its B to the B of chunk - 1 on this same rank (V-shape turn)."""
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """∂L/∂output of the last chunk (from C1 or C2) until its B."""

    # point to point
    posted_receives: dict[P2PKey, PostedReceive] = field(default_factory=dict)
    """Receives whose batch may still be in flight."""
    received: dict[P2PKey, torch.Tensor] = field(default_factory=dict)
    """Receives complete (their pass waited for them) and not yet taken."""
    send_batches: deque[Batch] = field(default_factory=deque)
    """Batches with sends and no receive, in issue order, until they complete (the oldest polled between
    passes)."""

    # input embedding (vocabulary parallel)
    embed_partials: dict[int, torch.Tensor] = field(default_factory=dict)
    """This shard's IF partial until IF_REDUCE sends it."""
    embed_reduces: dict[int, Pending] = field(default_factory=dict)
    """IF_REDUCE on chunk 0's rank: the full embedding output for F of chunk 0."""
    embed_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    """∂L/∂embedding output from B of chunk 0 until IB_BCAST sends it."""
    embed_grad_bcasts: dict[int, Pending] = field(default_factory=dict)
    """IB_BCAST: the embedding output's gradient for IB."""
    unconsumed: list[Pending] = field(default_factory=list)
    """Chains whose result nobody on this rank takes (IF_REDUCE off chunk 0's rank): waited at the end."""

    # output layer (vocabulary parallel)
    hidden_bcasts: dict[int, Pending] = field(default_factory=dict)
    """C0: the last chunk's output X for S."""
    output_states: dict[int, OutputState] = field(default_factory=dict)
    """S -> T (vocab-1: -> C2) state of the output layer; dropped when its big tensors are dead."""
    output_chains: dict[tuple[Op, int], Pending] = field(default_factory=dict)
    """C1 / C2 in flight, until a pass (or the end of the step) completes them."""
    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    """Microbatch -> Σ_n g_n·loss_n, from when it is known (after C1; baseline: the last chunk's F)."""

    # counts for the simulator's units
    microbatches_in_flight: PeakCount = field(default_factory=PeakCount)
    """(mb, chunk) activations held from F to B (or W), each weighing its chunk's share of the layers."""
    stashes: PeakCount = field(default_factory=PeakCount)
    """Microbatches whose output-layer S->T state is held."""
