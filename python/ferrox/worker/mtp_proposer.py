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

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.attention.kv_cache import kv_cache_shape
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.loader.source import ModelSource
from ferrox.loader.weights import iter_safetensors_prefixed
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.worker.draft_model import _DraftStep, scratch_block_tables, scratch_blocks_per_request
from ferrox.worker.step_inputs import Uploader, attention_metadata


@dataclass(slots=True)
class _Pending:
    slot: int  # the core's request slot
    position: int  # of its last sampled token (its KV not computed yet)
    blocks: npt.NDArray[np.int32]  # its block table row


def mtp_kv_shape(spec: Any, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """The MTP layer's cache: one full-attention layer of the target's shape."""
    for i in range(spec.num_layers):
        shape = kv_cache_shape(spec, num_blocks, block_size, 1, i)
        if shape[3]:
            return shape
    raise UnsupportedModelError(f"{spec.architecture} has no attention layer to shape an MTP layer's cache on")


def load_predictor(target: Any, source: ModelSource, load_format: str, seed: int, quant_config: Any) -> Any:
    """The target's MTP layer (`multi_token_predictor`), its weights read from the checkpoint's mtp.* tensors
    (random under load_format 'dummy'); UnsupportedModelError for a model without one."""
    build = getattr(target, "multi_token_predictor", None)
    if build is None:
        raise UnsupportedModelError(f"speculative_config.method 'mtp': {type(target).__name__} has no "
                                    "multi-token-prediction layer in ferrox (Qwen3.5 / Qwen3.6 / Qwen3-Next and "
                                    "GLM-4.5 / 4.6 / 4.7 have)")
    with torch.no_grad():
        predictor = build(quant_config)
        if load_format == "dummy":
            init_dummy_weights(predictor, seed)
        else:
            if source.format != "hf":
                raise ModelLoadError(f"speculative_config.method 'mtp': the MTP layer is read from a Hugging Face "
                                     f"folder's safetensors, {source.path} is not one")
            prefix = predictor.checkpoint_prefix
            tensors = list(iter_safetensors_prefixed(source.path, prefix))
            if not tensors:
                raise ModelLoadError(f"speculative_config.method 'mtp': {source.path} has no {prefix}* tensors (the "
                                     "checkpoint's multi-token-prediction layer); serve a release that keeps them, "
                                     "or use method 'ngram' or 'draft_model'")
            predictor.load_weights(tensors)
        predictor.finalize_weights()
    predictor.eval()
    predictor.requires_grad_(False)
    return predictor


class MtpProposer:
    def __init__(self, predictor: Any, *, num_speculative_tokens: int, num_blocks: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.predictor = predictor
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.scratch_per_req = scratch_blocks_per_request(block_size, self.k)
        shape = mtp_kv_shape(predictor.spec, num_blocks + max_num_seqs * self.scratch_per_req, block_size)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.upload = Uploader(device)
        self._round_uploads = [Uploader(device) for _ in range(max(self.k - 1, 1))]
        self._pending: list[_Pending] = []
        # The first draft of each pending request and the layer's output that gave it (device).
        self._first: tuple[torch.Tensor, torch.Tensor] | None = None
        # Partial-prefill requests: the hidden state of their last computed position (its next token comes
        # with the next chunk), and that position.
        self._deferred: dict[str, tuple[torch.Tensor, int]] = {}

    def shadow(self, so: Any) -> None:
        """(A draft model's pass over the step's tokens, right after its launch; the MTP layer's waits for the
        sampled tokens: record.)"""

    def forget(self) -> None:
        self._pending = []
        self._first = None
        self._deferred.clear()

    @torch.inference_mode()
    def record(self, handle: Any, outs: Any) -> None:
        """After update_from_output of a synchronous step: the MTP layer over the step's pairs (module docstring),
        and the first drafts of the requests that go on."""
        so, hidden = handle.so, handle.hidden
        self._pending, self._first = [], None
        if hidden is None or not so.num_reqs:
            return
        qsl = np.asarray(so.query_start_loc, dtype=np.int64)
        counts = np.asarray(so.num_scheduled_tokens, dtype=np.int64)
        ids = np.asarray(so.input_ids, dtype=np.int64)
        positions = np.asarray(so.positions, dtype=np.int64)
        slot_mapping = np.asarray(so.slot_mapping, dtype=np.int64)
        block_table = np.asarray(so.block_table, dtype=np.int32)
        drafts = np.asarray(so.num_draft_tokens, dtype=np.int64)
        sample_mask = np.asarray(so.sample_mask, dtype=np.bool_)
        slots = np.asarray(so.req_slots, dtype=np.int64)
        appended: dict[int, tuple[int, int, bool]] = {}  # slot -> (tokens appended, the last, finished)
        offsets = outs.token_offsets
        for j, slot in enumerate(outs.slots.tolist()):
            c = int(offsets[j + 1] - offsets[j])
            appended[slot] = (c, int(outs.token_ids[offsets[j + 1] - 1]) if c else 0, bool(outs.finish_reasons[j]))
        bs, t = self.block_size, int(so.num_tokens)
        rows: list[npt.NDArray[np.int64]] = []  # per batch row: the step's hidden rows of its pairs
        tok, pos, slot_of, q_lens, seq_lens, tables, extra = [], [], [], [], [], [], []
        last_pair: list[tuple[int, int, int]] = []  # (slot, row in the pass, batch row) of requests going on
        deferred_rows: list[torch.Tensor] = []
        n_pairs = 0
        # A deferred pair lives one step: its request's next chunk, or never (preempted, aborted, or not scheduled:
        # the pair is lost, an approximation).
        held_over, self._deferred = self._deferred, {}
        for r in range(len(slots)):
            qs, n, rid = int(qsl[r]), int(counts[r]), so.req_ids[r]
            p0 = int(positions[qs])
            c, last, finished = appended.get(int(slots[r]), (0, 0, True))
            # Pairs (hidden row, next token) of this row, in position order.
            r_rows, r_tok, r_pos, r_slot = [], [], [], []
            held = held_over.get(rid)
            if held is not None and held[1] == p0 - 1:
                prev = p0 - 1
                r_rows.append(-1 - len(deferred_rows))
                deferred_rows.append(held[0])
                r_tok.append(int(ids[qs]))
                r_pos.append(prev)
                r_slot.append(int(block_table[r, prev // bs]) * bs + prev % bs)
            if c:  # a sampled row: its kept positions (a verify step's rejected ones left out)
                m = n - (int(drafts[r]) - (c - 1))
                nxt = np.append(ids[qs + 1:qs + m], last)
            else:  # a partial prefill (or a row that ended unsampled): the last position waits for its token
                m = n - 1
                nxt = ids[qs + 1:qs + n]
                if not sample_mask[r]:
                    self._deferred[rid] = (hidden[qs + n - 1].clone(), p0 + n - 1)
            r_rows.extend(range(qs, qs + m))
            r_tok.extend(nxt[:m].tolist())
            r_pos.extend(positions[qs:qs + m].tolist())
            r_slot.extend(slot_mapping[qs:qs + m].tolist())
            if not r_rows:
                continue
            if c and not finished:
                last_pair.append((int(slots[r]), n_pairs + len(r_rows) - 1, r))
            n_pairs += len(r_rows)
            rows.append(np.array(r_rows, dtype=np.int64))
            tok.extend(r_tok)
            pos.extend(r_pos)
            slot_of.extend(r_slot)
            q_lens.append(len(r_rows))
            seq_lens.append(r_pos[-1] + 1)
            tables.append(block_table[r])
            extra.append(r)
        if not q_lens:
            return
        src = np.concatenate(rows)
        src = np.where(src >= 0, src, t - 1 - src)  # deferred rows follow the step's
        h_all = hidden[:t] if not deferred_rows else torch.cat([hidden[:t], torch.stack(deferred_rows)])
        step = _DraftStep(
            query_start_loc=np.concatenate(([0], np.cumsum(q_lens))).astype(np.int32),
            seq_lens=np.array(seq_lens, dtype=np.int32),
            num_scheduled_tokens=np.array(q_lens, dtype=np.int32),
            slot_mapping=np.array(slot_of, dtype=np.int64),
            block_table=np.ascontiguousarray(np.stack(tables)),
        )
        upload = self.upload
        upload.next_step()
        meta = attention_metadata(step, upload)
        h_in = h_all.index_select(0, upload("rows", src))
        out = self.predictor(upload("ids", np.array(tok, dtype=np.int64)), upload("positions", np.array(pos)),
                             h_in, self.kv_cache, meta)
        if not last_pair:
            return
        # The last sampled token's position: after the row's last kept position (p0 + m - 1 above).
        self._pending = [_Pending(slot, int(positions[int(qsl[r])]) + int(counts[r]) - int(drafts[r])
                                  + appended[slot][0] - 1, block_table[r].copy()) for slot, _, r in last_pair]
        at = upload("last_pairs", np.array([i for _, i, _ in last_pair], dtype=np.int64))
        o = out.index_select(0, at)
        self._first = (self.predictor.compute_logits(o).argmax(dim=-1), o)

    @torch.inference_mode()
    def propose(self) -> dict[str, npt.NDArray[Any]]:
        """schedule()'s draft_slots / draft_token_ids / draft_offsets for the recorded requests ({} if none)."""
        pending, first = self._pending, self._first
        self._pending, self._first = [], None
        keep = [i for i, r in enumerate(pending) if self.max_model_len - 1 - r.position > 0]
        if not keep or first is None:
            return {}
        reqs = [pending[i] for i in keep]
        kept = torch.tensor(keep, dtype=torch.int64, device=first[0].device)
        last, o = first[0].index_select(0, kept), first[1].index_select(0, kept)
        bs, n = self.block_size, len(reqs)
        budget = np.array([min(self.k, self.max_model_len - 1 - r.position) for r in reqs])
        pos0 = np.array([r.position for r in reqs], dtype=np.int64)
        drafts_dev = torch.zeros((self.k, n), dtype=torch.int64, device=last.device)
        drafts_dev[0] = last
        if int(budget.max()) > 1:
            scratch, table = scratch_block_tables(pos0, [r.blocks for r in reqs], bs, self.num_blocks,
                                                  self.scratch_per_req, [self.kv_cache])
            # Round j: the pair (output j - 1, draft j) at position pos0 + j - 1 proposes draft j + 1; the rounds
            # queue back to back on the device and the host reads the drafts once, at the end.
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
                out = self.predictor(last.index_select(0, rows), upload("positions", pos0[active] + j - 1),
                                     o.index_select(0, rows), self.kv_cache, meta)
                proposed = self.predictor.compute_logits(out).argmax(dim=-1)
                drafts_dev[j].index_copy_(0, rows, proposed)
                last.index_copy_(0, rows, proposed)
                o.index_copy_(0, rows, out)
        drafts = drafts_dev.t().cpu().numpy()
        counts = budget.astype(np.int32)
        return {
            "draft_slots": np.array([r.slot for r in reqs], dtype=np.int32),
            "draft_token_ids": np.concatenate([drafts[i, : counts[i]] for i in range(n)]),
            "draft_offsets": np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
        }
