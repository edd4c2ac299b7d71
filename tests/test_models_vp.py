"""Vocabulary-parallel ends on 2 and 3 gloo ranks: loss and every gradient equal the HF model's.

Each rank builds its RankModules ("vocab" placement) from the same seeded HF model and runs one
microbatch with the stages in plain sequence (no schedule): IF + reduce, chunk forwards with
send/recv between owners, C0, S/C1/T (vocab-2), chunk backwards, IB + scatter-add. The parent
compares with HF's autograd. The 2-rank run also exports the trained-shape model with
`export_hf` and reloads it with `from_pretrained`.
"""

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from helpers.tiny import tiny_config
from vp_accelerate.distributed import spawn
from vp_accelerate.models import StageLayout, build_rank, gather_state_dict, save_hf
from vp_accelerate.vocab.embedding import embed_backward, embed_partial, ib_broadcast, if_reduce
from vp_accelerate.vocab.output_layer import OutputLayerOptions, broadcast_x, run_output_layer, token_mean_grad_scale
from vp_accelerate.vocab.partition import VocabPartition

# (family, tie, layout kind) per world size: tied and untied, 1-chunk, V-shape, interleaved, uneven.
CASES = {
    2: [("llama", False, "vshape"), ("gemma2", None, "1f1b"), ("gpt2", None, "interleaved"), ("qwen3", True, "1f1b")],
    3: [("qwen2", False, "uneven"), ("gemma", None, "vshape"), ("cohere", None, "1f1b"), ("gpt_neox", False, "1f1b")],
}
SEQ = (2, 9)


def make_layout(kind, n, p):
    if kind == "vshape":
        return StageLayout.v_shape(n, p)
    if kind == "interleaved":
        return StageLayout.interleaved(n, p, 2)
    if kind == "uneven":
        return StageLayout.one_per_rank(n, p, layer_counts=[2] + [1] * (p - 2) + [n - p])
    return StageLayout.one_per_rank(n, p)


def make_case(family, tie, seed):
    num_layers = 6
    torch.manual_seed(seed)
    cfg = tiny_config(family, tie=tie, num_layers=num_layers)
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, cfg.vocab_size, SEQ, generator=gen)  # not the padding id (HF gives it no grad)
    labels = torch.cat([ids[:, 1:], torch.full((SEQ[0], 1), -100)], dim=1)
    labels[0, 3] = -100  # an ignored token inside a sequence
    return ref, ids, labels


def run_vp_sequential(mods, ids, labels, part, opts):
    """One microbatch through every rank's pieces in model order; returns (loss, {HF name: grad})."""
    lay, rank = mods.layout, mods.rank
    b, s = ids.shape
    h = mods.embed_weight.shape[1]
    # IF: every rank looks up its shard's ids; the sum lands on chunk 0's owner.
    emb = if_reduce(embed_partial(ids, mods.embed_weight.detach(), part, rank), dst=lay.first_rank).wait()
    acts, prev = {}, None
    for c, owner in enumerate(lay.chunk_rank):
        if owner != rank:
            continue
        if c == 0:
            inp = emb.detach().clone()
        elif lay.chunk_rank[c - 1] == rank:
            inp = prev.detach().clone()
        else:
            inp = torch.empty(b, s, h)
            dist.recv(inp, lay.chunk_rank[c - 1])
        inp.requires_grad_(True)
        out = mods.chunks[c](inp)
        acts[c] = (inp, out)
        prev = out
        if c + 1 < lay.num_chunks and lay.chunk_rank[c + 1] != rank:
            dist.send(out.detach().contiguous(), lay.chunk_rank[c + 1])
    last = lay.num_chunks - 1
    x = acts[last][1].detach().contiguous() if rank == lay.last_rank else torch.empty(b, s, h)
    broadcast_x(x, src=lay.last_rank)  # C0
    valid = int((labels != -100).sum())
    g = token_mean_grad_scale(labels.reshape(-1), valid)
    head_grad = torch.zeros_like(mods.head_weight)
    state = run_output_layer(x, labels, g, mods.head_weight.detach(), head_grad, part, rank, opts)  # S, C1, T
    grad_next = None
    for c in reversed(range(lay.num_chunks)):
        if lay.chunk_rank[c] != rank:
            continue
        inp, out = acts[c]
        if c == last:
            grad_out = state.grad_x.reshape(out.shape)
        elif lay.chunk_rank[c + 1] == rank:
            grad_out = grad_next
        else:
            grad_out = torch.empty_like(out)
            dist.recv(grad_out, lay.chunk_rank[c + 1])
        torch.autograd.backward(out, grad_out)
        grad_next = inp.grad
        if c > 0 and lay.chunk_rank[c - 1] != rank:
            dist.send(grad_next.contiguous(), lay.chunk_rank[c - 1])
    demb = acts[0][0].grad.contiguous() if rank == lay.first_rank else torch.empty(b, s, h)
    ib_broadcast(demb, src=lay.first_rank)  # IB
    embed_grad = head_grad if mods.tied else torch.zeros_like(mods.embed_weight)
    embed_backward(ids, demb, embed_grad, part, rank)
    grads = {name: p.grad.clone() for c in mods.chunks for name, p in mods.chunks[c].hf_named_parameters()}
    grads[mods.embed_name] = embed_grad
    grads[mods.head_name] = head_grad
    return state.loss_sum.item(), grads


def _worker(cases, export_dir):
    rank, p = dist.get_rank(), dist.get_world_size()
    results = []
    for i, (family, tie, kind) in enumerate(cases):
        ref, ids, labels = make_case(family, tie, seed=100 + i)
        layout = make_layout(kind, ref.config.num_hidden_layers, p)
        part = VocabPartition(ref.config.vocab_size, p)
        mods = build_rank(ref, layout, rank, "vocab", part).eval()
        opts = OutputLayerOptions(algorithm="vocab-2", softcap=mods.final_softcap, logit_scale=mods.logit_scale)
        loss, grads = run_vp_sequential(mods, ids, labels, part, opts)
        # numpy, not tensors: torch's queue would share tensor memory with a process about to exit.
        grads = {name: g.detach().numpy().copy() for name, g in grads.items()}
        results.append((loss, grads, sorted(mods.sharded_names), mods.param_bytes()))
        if export_dir is not None and i == 0:
            sd = gather_state_dict(mods)  # the gathered route of models/export.export_hf, a collective
            if sd is not None:
                save_hf(sd, mods.config, export_dir)
    return results


def _check(world_size, tmp_path):
    export_dir = str(tmp_path / "export") if world_size == 2 else None
    per_rank = spawn(_worker, world_size, CASES[world_size], export_dir, timeout_s=120)
    for i, (family, tie, kind) in enumerate(CASES[world_size]):
        ref, ids, labels = make_case(family, tie, seed=100 + i)
        logits = ref(input_ids=ids, use_cache=False).logits  # labels are already shifted: no HF shift
        want_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        want_loss.backward()
        want = {n: p.grad for n, p in ref.named_parameters()}
        losses = [r[i][0] for r in per_rank]
        assert max(abs(loss - want_loss.item()) for loss in losses) <= 1e-5 * want_loss.item(), (family, losses)
        sharded = set(per_rank[0][i][2])
        got = {}
        for r in per_rank:
            for name, grad in r[i][1].items():
                grad = torch.from_numpy(grad)
                if name in sharded:
                    got.setdefault(name, []).append(grad)
                else:
                    assert name not in got, f"{name} held by two ranks"
                    got[name] = grad
        V = ref.config.vocab_size
        for name in sharded:
            full = torch.cat(got[name])
            assert full[V:].abs().max() == 0, "padded rows must get no gradient"
            got[name] = full[:V]
        assert set(got) == set(want), (family, set(got) ^ set(want))
        for name, w in want.items():
            err = ((got[name] - w).abs().max() / w.abs().max()).item()
            assert err <= 1e-5, (family, kind, name, err)
    if export_dir is not None:
        ref, _, _ = make_case(*CASES[2][0][:2], seed=100)
        back = AutoModelForCausalLM.from_pretrained(export_dir)
        want_sd, got_sd = ref.state_dict(), back.state_dict()
        assert set(want_sd) == set(got_sd)
        for k in want_sd:
            assert torch.equal(want_sd[k], got_sd[k]), k


def test_vp_two_ranks_loss_and_grads_match_hf(tmp_path):
    _check(2, tmp_path)


def test_vp_three_ranks_loss_and_grads_match_hf(tmp_path):
    _check(3, tmp_path)
