"""MTP speculation (speculative_config method "mtp"): the checkpoint's multi-token-prediction layer drafts k tokens
per request per step from the target's own hidden states (models/qwen3_5_mtp.py says what the layer computes).

The layer's pair at position i is (h_i, t_{i+1}): the target's hidden state there and the token after it.
Its KV cache is a twin of the target's (same block ids, same positions, plus scratch blocks per request,
as worker/draft_model.py's), kept by one pass per step:

- record(handle, outs): after the core took a synchronous step's tokens, the layer runs over that step's
  pairs: each computed position's hidden state (the runner kept them: StepHandle.hidden) with the token that
  followed it -- the step's next input token, and at the last kept position the token just sampled. A
  verify step's rejected positions are left out (their hidden states are not the request's), and a partial
  prefill chunk's last position waits for the next chunk, whose first token is the one after it (deferred,
  keyed by request id). The output at each sampling request's last pair gives its first draft.
- propose(): before the next schedule(), k - 1 one-token rounds chain the drafts: the pair (previous output,
  previous draft) at the next position. Those positions go to scratch blocks (the target has not computed
  them; its blocks may not exist yet), as the draft model's proposals do.

Like a draft model's, the drafts are argmaxes (deterministic given the context), so the verifier treats
them as prompt-lookup drafts (draft_probs=None): exact for greedy and sampled requests alike, whatever the
drafts. Known approximations, which cost acceptance and never correctness: a prefix-cache hit reuses the twin
slot of the block's last position, written with the original request's next token (vLLM shares it the same
way); a multimodal prompt's image positions give the layer the placeholder token's embedding.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.attention.kv_cache import kv_cache_shape
from ferrox.distributed.step_channel import MTP_PASS, MTP_ROUNDS
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.loader.source import ModelSource
from ferrox.loader.weights import iter_safetensors_prefixed
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.worker.draft_model import _DraftStep, copy_blocks, scratch_blocks_per_request, scratch_plan
from ferrox.worker.mtp_graphs import MtpGraphs
from ferrox.worker.step_inputs import Uploader, attention_metadata

logger = logging.getLogger(__name__)

# Quantized tensors' scale names (block FP8's, per-channel FP8's): a weight beside one is quantized.
_SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")


@dataclass(slots=True)
class _Pending:
    slot: int  # the core's request slot
    position: int  # of its last sampled token (its KV not computed yet)
    blocks: npt.NDArray[np.int32]  # its block table row


def mtp_kv_shape(spec: Any, num_blocks: int, block_size: int, tp_size: int = 1) -> tuple[int, ...]:
    """The MTP layer's cache: one full-attention layer of the target's shape (this rank's heads)."""
    for i in range(spec.num_layers):
        shape = kv_cache_shape(spec, num_blocks, block_size, tp_size, i)
        if shape[3]:
            return shape
    raise UnsupportedModelError(f"{spec.architecture} has no attention layer to shape an MTP layer's cache on")


def load_predictor(target: Any, source: ModelSource, load_format: str, seed: int, quant_config: Any) -> Any:
    """The target's MTP layer (`multi_token_predictor`), its weights read from the checkpoint's mtp.* tensors
    (random under load_format 'dummy'); UnsupportedModelError for a model without one."""
    build = getattr(target, "multi_token_predictor", None)
    if build is None:
        raise UnsupportedModelError(f"speculative_config.method 'mtp': {type(target).__name__} has no "
                                    "multi-token-prediction layer in ferrox (Qwen3.5 / Qwen3.6 / Qwen3-Next, "
                                    "DeepSeek-V3 / R1, GLM-4.5 / 4.6 / 4.7 and Nemotron-H (Nemotron 3 Super) have)")
    with torch.no_grad():
        if load_format == "dummy":
            predictor = build(quant_config)
            init_dummy_weights(predictor, seed)
        else:
            if source.format != "hf":
                raise ModelLoadError(f"speculative_config.method 'mtp': the MTP layer is read from a Hugging Face "
                                     f"folder's safetensors, {source.path} is not one")
            prefix = target.mtp_checkpoint_prefix
            tensors = list(iter_safetensors_prefixed(source.path, prefix))
            if not tensors:
                raise ModelLoadError(f"speculative_config.method 'mtp': {source.path} has no {prefix}* tensors (the "
                                     "checkpoint's multi-token-prediction layer); serve a release that keeps them, "
                                     "or use method 'ngram' or 'draft_model'")
            # A quantized checkpoint may keep its MTP layer, or only its input projection, in float: the tensors say
            # (quantization at load, --quantization fp8 on float weights, takes the layer whole, as the model's).
            scaled = {name.rpartition(".")[0] for name, _ in tensors if name.endswith(_SCALE_SUFFIXES)}
            online = bool(getattr(quant_config, "online_quantization", False))
            # (the input projection: Qwen's fc, DeepSeek's eh_proj, Nemotron-H's on its first MTP block)
            fc = {f"{prefix}fc", f"{prefix}eh_proj", f"{prefix}layers.0.eh_proj"}
            predictor = build(quant_config if scaled or online else None, float_fc=not (online or scaled & fc))
            predictor.load_weights(tensors)
        predictor.finalize_weights()
    predictor.eval()
    predictor.requires_grad_(False)
    return predictor


@dataclass(slots=True)
class _PairPlan:
    """The MTP pass of one step (plan_pairs): its pairs in row order, each row's in position order."""

    src: npt.NDArray[np.int64]  # [P] the hidden row of each pair: the step's (< T), or T + i for held[i]
    tokens: npt.NDArray[np.int64]  # [P] the token after it
    positions: npt.NDArray[np.int64]  # [P]
    slots: npt.NDArray[np.int64]  # [P] KV slots (the twin cache's, the target's block ids)
    rows: npt.NDArray[np.int64]  # [R'] the batch rows that have pairs
    q_lens: npt.NDArray[np.int64]  # [R'] their pairs
    seq_lens: npt.NDArray[np.int64]  # [R'] their last pair's position + 1
    held: npt.NDArray[np.int64]  # the ids of the deferred pairs used, in order (their pairs' src: T + i)
    pending: npt.NDArray[np.int64]  # batch rows of the requests that sampled and go on
    pending_positions: npt.NDArray[np.int64]  # their last sampled token's position
    last_pairs: npt.NDArray[np.int64]  # their last pair's index in the pass (its output gives the first draft)
    partial: npt.NDArray[np.int64]  # batch rows of partial prefills: their last pair waits for the next chunk
    partial_rows: npt.NDArray[np.int64]  # their last hidden row in the step
    partial_positions: npt.NDArray[np.int64]  # and its position


def plan_pairs(so: Any, outs: Any, held_over: dict[str, tuple[int, int]], block_size: int) -> _PairPlan:
    """The pairs (h_i, t_{i+1}) a step gives the MTP layer (module docstring), vectorized over the batch: row r's
    m_r kept positions from its first (a sampled row: all but a verify step's rejected ones, the last paired with
    the token just sampled; an unsampled row: all but its last), after the pair its previous chunk deferred."""
    qsl = np.asarray(so.query_start_loc, dtype=np.int64)
    n = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
    ids = np.asarray(so.input_ids, dtype=np.int64)
    positions = np.asarray(so.positions, dtype=np.int64)
    slot_mapping = np.asarray(so.slot_mapping, dtype=np.int64)
    block_table = np.asarray(so.block_table, dtype=np.int64)
    drafts = np.asarray(so.num_draft_tokens, dtype=np.int64)
    sample_mask = np.asarray(so.sample_mask, dtype=np.bool_)
    slots = np.asarray(so.req_slots, dtype=np.int64)
    t, num_rows, bs = int(so.num_tokens), len(slots), block_size
    qs, p0 = qsl[:-1], positions[qsl[:-1]]
    # What the core appended to each row's request this step (tokens, the last, finished), by slot.
    out_slots = np.asarray(outs.slots, dtype=np.int64)
    offsets = np.asarray(outs.token_offsets, dtype=np.int64)
    lookup = np.full(int(max(slots.max(), out_slots.max(initial=0))) + 1, -1, dtype=np.int64)
    lookup[out_slots] = np.arange(out_slots.size)
    j = lookup[slots]  # (-1: the core reported nothing for it; it picks the padding below)
    c_out = np.diff(offsets)
    token_ids = np.asarray(outs.token_ids, dtype=np.int64)
    lasts = (np.where(c_out > 0, token_ids[np.maximum(offsets[1:] - 1, 0)], 0) if token_ids.size
             else np.zeros_like(c_out))
    c = np.append(c_out, 0)[j]
    last = np.append(lasts, 0)[j]
    finished = np.append(np.asarray(outs.finish_reasons) != 0, True)[j]
    m = np.where(c > 0, n - drafts + c - 1, n - 1)
    # Deferred pairs from the previous step (position p0 - 1, its hidden state held, its token this row's first).
    d = np.zeros(num_rows, dtype=np.int64)
    held: list[int] = []
    held_index = np.zeros(num_rows, dtype=np.int64)
    if held_over:
        for r, rid in enumerate(so.req_ids):
            entry = held_over.get(rid)
            if entry is not None and entry[1] == p0[r] - 1:
                d[r], held_index[r] = 1, len(held)
                held.append(entry[0])
    q = d + m
    start = np.cumsum(q) - q
    size = int(q.sum())
    src, tokens = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.int64)
    pos, kv_slots = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.int64)
    row_of = np.repeat(np.arange(num_rows), m)
    k = np.arange(row_of.size) - np.repeat(np.cumsum(m) - m, m)  # each pair's index in its row's run
    dst = start[row_of] + d[row_of] + k
    step_row = qs[row_of] + k
    src[dst] = step_row
    tokens[dst] = np.append(ids, 0)[step_row + 1]
    ends = (k == m[row_of] - 1) & (c[row_of] > 0)
    tokens[dst[ends]] = last[row_of[ends]]
    pos[dst], kv_slots[dst] = positions[step_row], slot_mapping[step_row]
    dr = np.flatnonzero(d)
    prev = p0[dr] - 1
    src[start[dr]] = t + held_index[dr]
    tokens[start[dr]] = ids[qs[dr]]
    pos[start[dr]] = prev
    kv_slots[start[dr]] = block_table[dr, prev // bs] * bs + prev % bs
    kept = np.flatnonzero(q > 0)
    pending = np.flatnonzero((c > 0) & ~finished)
    partial = np.flatnonzero((c == 0) & ~sample_mask)
    return _PairPlan(src=src, tokens=tokens, positions=pos, slots=kv_slots, rows=kept, q_lens=q[kept],
                     seq_lens=p0[kept] + m[kept], held=np.array(held, dtype=np.int64), pending=pending,
                     pending_positions=p0[pending] + m[pending], last_pairs=start[pending] + q[pending] - 1,
                     partial=partial, partial_rows=qs[partial] + n[partial] - 1,
                     partial_positions=p0[partial] + n[partial] - 1)


def mtp_proposer(config: Any, loaded: Any, tp_size: int = 1, channel: Any = None) -> MtpProposer | None:
    """This rank's MtpProposer under speculative_config method 'mtp' (None otherwise): the target's MTP layer (this
    rank's shard) and its twin KV cache."""
    from ferrox.speculative_config import parse_speculative_config

    spec = parse_speculative_config(config.speculative_config)
    if spec is None or spec.method != "mtp":
        return None
    predictor = load_predictor(loaded.model, loaded.source, config.load_format, config.seed, loaded.quant_config)
    return MtpProposer(predictor, num_speculative_tokens=spec.num_speculative_tokens, num_blocks=loaded.num_blocks,
                       block_size=config.block_size, max_num_seqs=loaded.max_num_seqs,
                       max_model_len=loaded.max_model_len, dtype=loaded.dtype, device=loaded.device, tp_size=tp_size,
                       channel=channel)


class MtpProposer:
    """The driver's (record, propose) plan each pass and round set as arrays and run them with run_pass / run_rounds;
    under tensor parallelism they send the arrays first (`channel`: MTP_PASS, MTP_ROUNDS) and every other rank runs
    the same two methods on its shard of the layer (executor/worker_main.py), so the collectives line up."""

    def __init__(self, predictor: Any, *, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, dtype: torch.dtype, device: torch.device, tp_size: int = 1,
                 channel: Any = None) -> None:
        self.predictor = predictor
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.channel = channel
        self.scratch_per_req = scratch_blocks_per_request(block_size, self.k)
        shape = mtp_kv_shape(predictor.spec, num_blocks + max_num_seqs * self.scratch_per_req, block_size, tp_size)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype, self.device, self.max_num_seqs, self.tp_size = dtype, torch.device(device), max_num_seqs, tp_size
        self.graphs: MtpGraphs | None = None  # capture_cuda_graphs
        self.upload = Uploader(device)
        self._round_uploads = [Uploader(device) for _ in range(max(self.k - 1, 1))]
        # Driver: the requests that sampled and go on (propose's), and the partial prefills' deferred pairs
        # (request id -> (its id below, its position)).
        self._pending: list[_Pending] = []
        self._deferred: dict[str, tuple[int, int]] = {}
        self._next_id = 0
        # Every rank: the deferred pairs' hidden states by id, and the first drafts (with the outputs that gave
        # them) of the pending requests, on the device.
        self._held: dict[int, torch.Tensor] = {}
        self._first: tuple[torch.Tensor, torch.Tensor] | None = None

    def capture_cuda_graphs(self, batch_sizes: list[int] | None) -> float:
        """The layer's decode and verify graphs (worker/mtp_graphs.py) at the target's decode batch sizes (None: the
        ladder up to max_num_seqs); on every rank, after the target's own graphs, so the captures' collectives line
        up under tensor parallelism. Returns the seconds taken."""
        if batch_sizes == [] or self.device.type != "cuda":
            return 0.0
        if not getattr(self.predictor.target, "supports_cuda_graphs", True):
            return 0.0  # (an attention backend that plans steps on the host, as the target's: eager, as the target)
        try:
            graphs = MtpGraphs(self.predictor, self.kv_cache, num_speculative_tokens=self.k,
                               max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                               block_size=self.block_size, dtype=self.dtype, device=self.device,
                               batch_sizes=batch_sizes)
            seconds = graphs.capture()
        except Exception:
            if self.tp_size > 1:
                raise  # the other ranks would wait in a collective this rank never joins
            logger.exception("the MTP layer's CUDA graph capture failed; its passes and rounds run eagerly")
            return 0.0
        self.graphs = graphs
        return seconds

    def shadow(self, so: Any) -> None:
        """(A draft model's pass over the step's tokens, right after its launch; the MTP layer's waits for the
        sampled tokens: record.)"""

    # ---- the driver ----------------------------------------------------------------------------------
    def record(self, handle: Any, outs: Any) -> None:
        """After update_from_output of a synchronous step: the MTP layer over the step's pairs (module docstring),
        and the first drafts of the requests that go on."""
        so, hidden = handle.so, handle.hidden
        self._pending = []
        if hidden is None or not so.num_reqs:
            self._first = None
            return
        # A deferred pair lives one step: its request's next chunk, or never (preempted, aborted, or not scheduled:
        # the pair is lost, an approximation).
        held_over, self._deferred = self._deferred, {}
        plan = plan_pairs(so, outs, held_over, self.block_size)
        ids = np.arange(self._next_id, self._next_id + plan.partial.size, dtype=np.int64)
        self._next_id += plan.partial.size
        for i, r in enumerate(plan.partial.tolist()):
            self._deferred[so.req_ids[r]] = (int(ids[i]), int(plan.partial_positions[i]))
        block_table = np.asarray(so.block_table, dtype=np.int32)
        slots = np.asarray(so.req_slots, dtype=np.int64)
        self._pending = [_Pending(int(slots[r]), int(p), block_table[r].copy())
                         for r, p in zip(plan.pending.tolist(), plan.pending_positions.tolist(), strict=True)]
        arrays: dict[str, npt.NDArray[Any]] = {"src": plan.src, "tokens": plan.tokens, "positions": plan.positions, "slots": plan.slots,
                  "q_lens": plan.q_lens, "seq_lens": plan.seq_lens, "block_table": block_table[plan.rows],
                  "last_pairs": plan.last_pairs, "held_ids": plan.held, "defer_rows": plan.partial_rows,
                  "defer_ids": ids, "num_tokens": np.array([so.num_tokens], dtype=np.int64)}
        if self.channel is not None:
            self.channel.send(MTP_PASS, arrays)
        self.run_pass(arrays, hidden)

    def propose(self) -> dict[str, npt.NDArray[Any]]:
        """schedule()'s draft_slots / draft_token_ids / draft_offsets for the recorded requests ({} if none)."""
        pending = self._pending
        self._pending = []
        keep = np.array([i for i, r in enumerate(pending) if self.max_model_len - 1 - r.position > 0], dtype=np.int64)
        if not keep.size or self._first is None:
            return {}
        reqs = [pending[i] for i in keep.tolist()]
        budget = np.array([min(self.k, self.max_model_len - 1 - r.position) for r in reqs], dtype=np.int64)
        pos0 = np.array([r.position for r in reqs], dtype=np.int64)
        arrays: dict[str, npt.NDArray[Any]] = {"keep": keep, "budget": budget, "pos0": pos0}
        if int(budget.max()) > 1:
            scratch, table, src, dst = scratch_plan(pos0, [r.blocks for r in reqs], self.block_size, self.num_blocks,
                                                    self.scratch_per_req)
            arrays.update(scratch=scratch, table=table, copy_src=src, copy_dst=dst)
        if self.channel is not None:
            self.channel.send(MTP_ROUNDS, arrays)
        drafts = self.run_rounds(arrays).t().cpu().numpy()
        return {
            "draft_slots": np.array([r.slot for r in reqs], dtype=np.int32),
            "draft_token_ids": np.concatenate([drafts[i, : budget[i]] for i in range(len(reqs))]),
            "draft_offsets": np.concatenate(([0], np.cumsum(budget))).astype(np.int32),
        }

    # ---- every rank ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_pass(self, arrays: dict[str, npt.NDArray[Any]], hidden: torch.Tensor) -> None:
        """The MTP layer over a step's pairs (record's arrays; `hidden`: the step's last hidden states), keeping the
        partial prefills' last hidden states and the pending requests' first drafts."""
        t = int(arrays["num_tokens"][0])
        held = [self._held[int(i)] for i in arrays["held_ids"].tolist()]
        defer_rows = arrays["defer_rows"]
        kept = hidden.index_select(0, torch.from_numpy(defer_rows).to(hidden.device)) if defer_rows.size else None
        self._held = {int(i): kept[j] for j, i in enumerate(arrays["defer_ids"].tolist())} if kept is not None else {}
        self._first = None
        q_lens = arrays["q_lens"]
        if not q_lens.size:
            return
        h_all = hidden[:t] if not held else torch.cat([hidden[:t], torch.stack(held)])
        step = _DraftStep(
            query_start_loc=np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32),
            seq_lens=arrays["seq_lens"].astype(np.int32),
            num_scheduled_tokens=q_lens.astype(np.int32),
            slot_mapping=arrays["slots"],
            block_table=np.ascontiguousarray(arrays["block_table"]),
        )
        upload = self.upload
        upload.next_step()
        meta = attention_metadata(step, upload)
        h_in = h_all.index_select(0, upload("rows", arrays["src"]))
        out = self._forward(upload("ids", arrays["tokens"]), upload("positions", arrays["positions"]), h_in, meta)
        if arrays["last_pairs"].size:
            o = out.index_select(0, upload("last_pairs", arrays["last_pairs"]))
            self._first = (self.predictor.compute_logits(o).argmax(dim=-1), o)

    @torch.inference_mode()
    def run_rounds(self, arrays: dict[str, npt.NDArray[Any]]) -> torch.Tensor:
        """The chained drafts [k, n] (device) of the pending requests propose() kept (its arrays)."""
        assert self._first is not None
        first, self._first = self._first, None
        kept = torch.from_numpy(arrays["keep"]).to(first[0].device)
        last, o = first[0].index_select(0, kept), first[1].index_select(0, kept)
        budget, pos0, bs = arrays["budget"], arrays["pos0"], self.block_size
        drafts = torch.zeros((self.k, len(pos0)), dtype=torch.int64, device=last.device)
        drafts[0] = last
        if int(budget.max()) <= 1:
            return drafts
        copy_blocks([self.kv_cache], arrays["copy_src"], arrays["copy_dst"])
        scratch, table = arrays["scratch"], arrays["table"]
        # Round j: the pair (output j - 1, draft j) at position pos0 + j - 1 proposes draft j + 1; the rounds queue
        # back to back on the device and the host reads the drafts once, at the end.
        for j in range(1, int(budget.max())):
            upload = self._round_uploads[j - 1]
            upload.next_step()
            active = np.flatnonzero(budget > j)
            offset = pos0[active] % bs + j - 1
            step = _DraftStep(
                query_start_loc=np.arange(active.size + 1, dtype=np.int32),
                seq_lens=(pos0[active] + j).astype(np.int32),
                num_scheduled_tokens=np.ones(active.size, dtype=np.int32),
                slot_mapping=(scratch[active] + offset // bs) * bs + offset % bs,
                block_table=np.ascontiguousarray(table[active]),
            )
            meta = attention_metadata(step, upload)
            rows = upload("active", active.astype(np.int64))
            out = self._forward(last.index_select(0, rows), upload("positions", pos0[active] + j - 1),
                                o.index_select(0, rows), meta)
            proposed = self.predictor.compute_logits(out).argmax(dim=-1)
            drafts[j].index_copy_(0, rows, proposed)
            last.index_copy_(0, rows, proposed)
            o.index_copy_(0, rows, out)
        return drafts

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 meta: Any) -> torch.Tensor:
        """The layer's output rows: a graph's replay where one fits the step, else eager. (A decode graph's output
        is a view of its static buffer: the callers take their rows out before the next call.)"""
        if self.graphs is not None and self.graphs.can_run(meta):
            return self.graphs.run(input_ids, positions, hidden, meta)
        return self.predictor(input_ids, positions, hidden, self.kv_cache, meta)
